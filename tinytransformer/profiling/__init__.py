"""Where the time goes: the profilers a run can switch on, and the analysis of the traces they write.

Recording (during a run)
  ranges.py                 profile_range: the named ranges the models put around their parts
  session.py                PyTorchProfilerSession: torch.profiler over a few training steps
  deepspeed_flops.py        DeepSpeed's FLOPS profiler around one forward pass
Reading a trace (standard library only: a GPU trace can be analysed on a laptop)
  trace.py                  finding and loading a trace file, and the events in it
  attribution.py            which operator, step and phase each kernel belongs to
  kernel_names.py           what a kernel is by its name: its family, and its phase in a graph replay
  analysis.py               the numbers: kernels per step, top operators and kernels, phase and family split,
                            summary
  tables.py                 the same as console tables, and the CSV and markdown report files
Commands
  report_cli.py             python -m tinytransformer.profiling.report_cli TRACE
  pytorch_profiler_cli.py   every version's run_pytorch_profiler.py
  deepspeed_flops_cli.py    every version's run_deepspeed_flops.py (its summary: flops_summary.py; its plot:
                            roofline.py; the FLOP formulas: tinytransformer/flops.py)

The vendor profilers (rocprofv3, rocprof-sys, rocprof-compute, nsys, ncu) are run by the shell wrappers in
profilers/; single kernels are timed by tinytransformer/kernel_bench/, whole training runs compared by benchmarks/.
"""
