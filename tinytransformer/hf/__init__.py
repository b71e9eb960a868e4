"""Hugging Face `transformers` interop: the workshop's model as a LlamaForCausalLM, and back.

    model.py      LlamaConfig from our ModelConfig, the canonical <-> Hugging Face weight names, HFTinyLlama (the
                  peer row of the benchmarks: Hugging Face's model behind our model contract), Liger-Kernel
    convert.py    a checkpoint -> a Hugging Face model directory (config.json + model.safetensors), and back
    __main__.py   the command: python -m tinytransformer.hf export | import

`transformers` and `safetensors` are optional (requirements-peers.txt); without them these commands and the peer
rows say how to install them.
"""
