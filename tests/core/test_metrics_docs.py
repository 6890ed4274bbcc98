"""Every metric name the code records is in docs/metrics.md, and every name there is recorded.

The names are found on the source with `ast`, not by running anything: every string of
`headrace/` shaped like a metric name under one of PREFIXES (`"actor/env_s"`, a key of a buffer's
`stats()`, a constant such as `train_step.SKIPPED`), f-strings included (`f"trace/{stage}_s"`). A
name must appear in docs/metrics.md in backticks. An f-string whose placeholder the code
enumerates is resolved here (`resolved`) and every name it makes must be documented; any other
must appear as written, placeholders compared loosely (`buffer/depth_shard{i}` matches
`buffer/depth_shard{index}` or `<i>`). A name read with a distribution's suffix
(`learner/step_s_p90`, `metrics.core.SERIES`) is documented through its base. Every name a registry
is called with (`count`, `gauge`, `observe`, ..., `declare`) must start with one of PREFIXES, so a
metric under a new prefix fails here until the list and the page have it.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"

# The groups of docs/metrics.md. Paths ("headrace/..."), task ids and URLs start otherwise.
PREFIXES = ("actor", "batch", "buffer", "env", "episode", "eval", "gateway", "is", "learner",
            "loss", "reward", "sft", "staleness", "text", "trace", "weights")
NAME = re.compile(rf"(?:{'|'.join(PREFIXES)})/[A-Za-z0-9_{{}}]+")
LOOKS_LIKE_NAME = re.compile(r"[a-z_]+/")
RECORDING = {"count", "gauge", "observe", "observe_many", "average", "average_many",
             "declare"}
PLACEHOLDER = re.compile(r"\{[^{}]*\}|<[^<>]*>")
TABLE_ROW = re.compile(r"^\| `([^`]+)` \|", re.MULTILINE)


def _normal(name: str) -> str:
    """`name` with every placeholder written `{}`."""
    return PLACEHOLDER.sub("{}", name)


@functools.cache
def resolved() -> dict[str, tuple[str, ...]]:
    """Every name each enumerable f-string of the code makes, keyed by its `_normal` form."""
    from headrace.buffer.serialize import QUARANTINE_REASONS
    from headrace.learner.gate import DROP_AGE, DROP_LAG
    from headrace.metrics.traces import GROUP_STAGES, durations

    # A trace with every stamp and one episode of one call and one step: every stage it defines.
    stamps = {stamp: 0.0 for _, start, end in GROUP_STAGES for stamp in (start, end)}
    episode = {"started": 0.0, "finished": 1.0, "inference": [[0.0, 0.0, 1.0, 1]],
               "env": [[0.0, 1.0]]}
    stages = durations({"stages": stamps, "episodes": [episode]})
    return {
        "trace/{}_s": tuple(f"trace/{stage}_s" for stage in stages),  # metrics.traces
        "buffer/quarantined_{}": tuple(f"buffer/quarantined_{r}" for r in QUARANTINE_REASONS),
        "staleness/dropped_{}": (f"staleness/dropped_{DROP_LAG}",  # runtime.accounting
                                 f"staleness/dropped_{DROP_AGE}"),
    }


def _text(node: ast.AST) -> str | None:
    """A string constant's value, or an f-string's text with its fields as `{expression}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant)
                       else "{" + ast.unparse(part.value) + "}" for part in node.values)
    return None


def scan(sources: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(metric-like name -> where it first occurs, problems) of `sources` (path -> code)."""
    names: dict[str, str] = {}
    problems: list[str] = []
    for path, code in sorted(sources.items()):
        tree = ast.parse(code, filename=path)
        parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                 for part in node.values}  # the pieces of an f-string are not names alone
        for node in ast.walk(tree):
            text = None if id(node) in parts else _text(node)
            if text is not None and NAME.fullmatch(text):
                names.setdefault(text, f"{path}:{node.lineno}")
            if isinstance(node, ast.Call) and node.args:
                called = getattr(node.func, "attr", getattr(node.func, "id", None))
                first = _text(node.args[0])
                if (called in RECORDING and first is not None and LOOKS_LIKE_NAME.match(first)
                        and not NAME.fullmatch(first)):
                    problems.append(f"{path}:{node.lineno}: {called}({first!r}): not under a "
                                    f"known prefix ({', '.join(PREFIXES)}); add its group to "
                                    "docs/metrics.md and PREFIXES")
    return names, problems


def documented_names(doc: str) -> set[str]:
    return {_normal(span) for span in re.findall(r"`([^`\n]+)`", doc)}


def undocumented(sources: dict[str, str], doc: str) -> list[str]:
    """One line per name of `sources` missing from `doc` (and per problem of `scan`)."""
    from headrace.metrics.core import SERIES

    names, problems = scan(sources)
    known = documented_names(doc)
    for name, where in sorted(names.items()):
        key = _normal(name)
        if key in resolved():
            problems += [f"{where}: {full} (from {name!r})" for full in resolved()[key]
                         if full not in known]
        elif key not in known and not any(
                name.endswith(suffix) and name[:-len(suffix)] in known for suffix, _, _ in SERIES):
            problems.append(f"{where}: {name}")
    return problems


def _sources() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text()
            for path in (ROOT / "headrace").rglob("*.py")}


def test_every_recorded_metric_is_documented():
    missing = undocumented(_sources(), DOC.read_text())
    assert not missing, ("metric names not in docs/metrics.md (document each in its group's "
                         "table, in backticks):\n" + "\n".join(missing))


def test_every_documented_metric_is_recorded():
    """The first cell of every table row of the page names something the code records."""
    names, _ = scan(_sources())
    recorded = {_normal(name) for name in names}
    recorded |= {full for fulls in resolved().values() for full in fulls}
    rows = [name for name in TABLE_ROW.findall(DOC.read_text()) if NAME.fullmatch(name)]
    assert len(rows) > 100  # the page's tables were read
    stale = [name for name in rows if _normal(name) not in recorded]
    assert not stale, f"docs/metrics.md lists names no code records: {stale}"


def test_the_scan_finds_the_code_s_names():
    names, problems = scan(_sources())
    assert not problems
    for name in ("actor/episodes", "learner/skipped_nonfinite", "buffer/put_ms_p99",
                 "trace/{stage}_s", "buffer/quarantined_{r}", "sft/loss", "is/ess"):
        assert name in names, name
    assert "buffer/quarantined_" not in names  # a piece of an f-string, not a name


def test_a_new_metric_without_docs_fails():
    doc = "| `actor/episodes` | counter | ... |\n`trace/{stage}_s`"
    code = '''
def record(metrics, stage, i):
    metrics.count("actor/episodes")
    metrics.count("actor/brand_new")
    metrics.observe(f"trace/{stage}_s", 1.0)
    metrics.gauge(f"buffer/depth_shard{i}", 1.0)
    metrics.gauge("newgroup/thing", 1.0)
    stats = {"learner/step_s_p90": 1.0}
'''
    problems = "\n".join(undocumented({"headrace/x.py": code}, doc))
    assert "actor/brand_new" in problems
    assert "trace/admission_s" in problems  # resolved: the pattern alone is not enough
    assert "buffer/depth_shard{i}" in problems
    assert "newgroup/thing" in problems and "known prefix" in problems
    assert "learner/step_s_p90" in problems  # its base is not documented here
    assert "actor/episodes" not in problems
