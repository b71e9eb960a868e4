"""The kernel report's JSON (--output-json), read back by --from-json: every field the tables use is checked
first, so a hand-edited or cut-short report is one line (ConfigError) naming the file and the field, not a
traceback half-way through the table."""
from __future__ import annotations

from tinytransformer.checks import ConfigError
from tinytransformer.profiling.result_fields import Fields, read_json_file

from .report import OK

REPORT = "a kernel report written by --output-json"


def _check_compiled(row: Fields) -> None:
    """The resources of a configuration that compiled: counts are whole numbers >= 0."""
    for key in ("registers", "spills", "scratch_bytes", "shared_bytes"):
        row.integer(key, 0)
    if "sgprs" in row.data:   # an AMD target also reports its scalar and accumulation registers
        for key in ("agprs", "sgprs", "vgpr_spills", "sgpr_spills"):
            row.integer(key, 0)
    occupancy = row.section("occupancy")
    occupancy.number("value", minimum=0.0)
    occupancy.number("max", positive=True)
    occupancy.text("limited_by")


def check_row(row: Fields, targets: dict) -> None:
    for key in ("kernel", "source", "status"):
        row.text(key)
    if row.text("target") not in targets:
        raise ConfigError(f"{row.name('target')} is {row.data['target']!r}, not one of the report's targets "
                          f"({', '.join(targets)})")
    config = row.section("config")
    config.integer("num_warps", 1)
    config.integer("num_stages", 0)
    for key in [k for k in config.data if k.startswith("BLOCK")]:
        config.integer(key, 1)
    if row.data["status"] == OK:
        _check_compiled(row)
    else:
        row.text("error", optional=True)


def read_report(path: str) -> dict:
    """The report in `path`, once its header, its targets and every row are checked."""
    try:
        doc = read_json_file(path, REPORT)
    except ConfigError as error:
        raise ConfigError(f"--from-json: cannot read a report ({error})") from None
    report = Fields(doc, path, what=REPORT)
    for key in ("command", "where", "triton"):
        report.text(key)
    report.texts("presets")
    targets = report.section("targets")
    for name in targets.data:
        targets.section(name).text("gpus")
    for row in report.items("rows"):
        check_row(row, targets.data)
    return doc
