"""Shapes, memory floor, result rows and markdown tables of bench_vs_fla.py (standard library only, so the
join and the tables run anywhere, and the CPU tests check them without a GPU).

Chunk cells are ``(gate, shape)`` with shape ``MBSxSEQ:H`` (packed equal sequences, K = V = 128); layer cells
are ``1xT`` (FLA's KimiDeltaAttention defaults). One record is one implementation measured in one cell:
``impl`` is ``kdakit`` (with ``pipeline``: ``default`` for ``pipeline=None``, or the pipeline's name) or ``fla``.
Rows join the records of a cell: the first kdakit pipeline of the run fills the ``kdakit_*`` columns, every
other one ``kdakit_<pipeline>_*``.
"""

from __future__ import annotations

import json

GIB = 2.0 ** 30
D = 128
GATES = ("safe", "softplus", "raw")
SHAPES = ("1x8192:96", "8x8192:16", "1x8192:128", "1x131072:96")
LAYER_TOKENS = (8192, 32768)
PIPELINES = ("default", "chunk64_fast")
STATUSES = ("ok", "oom", "error", "timeout", "skipped")
MEASURES = ("fwd_ms", "fwd_nograd_ms", "fwd_bwd_ms", "peak_alloc_gib", "peak_reserved_gib")


def parse_shape(text: str) -> tuple[int, int, int]:
    """``MBSxSEQ:H`` -> (mbs, seq, H); ValueError naming the text otherwise."""
    try:
        mbs_seq, heads = text.strip().split(":")
        mbs, seq = mbs_seq.lower().split("x")
        out = int(mbs), int(seq), int(heads)
    except ValueError:
        raise ValueError(f"shape must read MBSxSEQ:H (e.g. 1x8192:96), got {text!r}") from None
    if min(out) < 1:
        raise ValueError(f"shape must have positive MBS, SEQ and H, got {text!r}")
    return out


def parse_list(text: str, allowed, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what}: expected a comma-separated list of {allowed}, got {text!r}")
    if allowed is not None:
        bad = [t for t in items if t not in allowed]
        if bad:
            raise ValueError(f"{what}: expected some of {tuple(allowed)}, got {bad}")
    return items


def floor_bytes(mbs: int, seq: int, heads: int, gate: str, d: int = D) -> int:
    """Bytes that must be live at a forward+backward's peak: q, k, v, g, beta, dO, O and the five token
    gradients, each in its own dtype (bf16, except the raw gate's g and dg in fp32). The gate parameters
    (A_log, dt_bias: O(H * D), independent of T) are not counted. bf16 everything: 20*T*H*D + 4*T*H."""
    T = mbs * seq
    g_bytes = 4 if gate == "raw" else 2
    per_pair = (3 * 2 + g_bytes) * d + 2    # q, k, v, g, beta
    return T * heads * (2 * per_pair + 2 * 2 * d)   # inputs + gradients, dO + O


def floor_gib(shape: str, gate: str) -> float:
    return floor_bytes(*parse_shape(shape), gate) / GIB


def impl_key(record: dict) -> str:
    """``fla`` or ``kdakit:<pipeline>``."""
    return "fla" if record["impl"] == "fla" else f"kdakit:{record.get('pipeline') or 'default'}"


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def _cell_of(r: dict) -> tuple:
    return (r.get("gate"), r["shape"])


def build_rows(records: list[dict], pipelines: list[str], kind: str = "chunk") -> list[dict]:
    """One row per cell (in the records' order); a later ok record of the same (cell, impl) replaces an earlier one,
    and an ok record is never replaced by a failed one (so merged runs keep what each measured)."""
    order, by = [], {}
    for r in records:
        cell = _cell_of(r)
        if cell not in order:
            order.append(cell)
        key = (cell, impl_key(r))
        prev = by.get(key)
        if prev is None or r.get("status") == "ok" or prev.get("status") != "ok":
            by[key] = r
    rows = []
    for cell in order:
        gate, shape = cell
        row = {"gate": gate, "shape": shape} if kind == "chunk" else {"shape": shape}
        if kind == "chunk":
            row["floor_gib"] = floor_gib(shape, gate)
        fla = by.get((cell, "fla"))
        _side(row, "fla", fla)
        for i, p in enumerate(pipelines):
            rec = by.get((cell, f"kdakit:{p}"))
            prefix = "kdakit" if i == 0 else f"kdakit_{p}"
            _side(row, prefix, rec)
            if rec is not None and rec.get("status") == "ok":
                row[f"{prefix}_pipeline_arg"] = None if p == "default" else p
                row[f"{prefix}_pipeline_ran"] = rec.get("pipeline_ran")
                row[f"{prefix}_accuracy_vs_fla"] = rec.get("accuracy_vs_fla")
                if fla is not None and fla.get("status") == "ok":
                    tag = "" if i == 0 else f"_{p}"
                    row[f"fwd_ratio{tag}"] = _ratio(rec.get("fwd_ms"), fla.get("fwd_ms"))
                    row[f"fwd_bwd_ratio{tag}"] = _ratio(rec.get("fwd_bwd_ms"), fla.get("fwd_bwd_ms"))
                    row[f"peak_ratio{tag}"] = _ratio(rec.get("peak_alloc_gib"), fla.get("peak_alloc_gib"))
                    row[f"reserved_ratio{tag}"] = _ratio(rec.get("peak_reserved_gib"), fla.get("peak_reserved_gib"))
        rows.append(row)
    return rows


def _side(row: dict, prefix: str, rec: dict | None) -> None:
    if rec is None:
        row[f"{prefix}_status"] = "not run"
        return
    row[f"{prefix}_status"] = rec.get("status")
    if rec.get("status") != "ok":
        row[f"{prefix}_message"] = rec.get("message")
        return
    for k in MEASURES + ("base_alloc_gib", "peak_reserved_above_base_gib", "process"):
        if k in rec:
            row[f"{prefix}_{k}"] = rec[k]


def accuracy(samples_kdakit: dict, samples_fla: dict, rel_rms) -> dict:
    """Relative RMS of each sampled tensor of kdakit against FLA's (``rel_rms(ref, got)``)."""
    out = {}
    for name, ref in samples_fla.items():
        if name in samples_kdakit:
            out[name] = rel_rms(ref, samples_kdakit[name])
    return out


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _pair(row, a, b, spec):
    return f"{_f(row.get(a), spec)} / {_f(row.get(b), spec)}"


def _status_or(row, prefix, text):
    s = row.get(f"{prefix}_status")
    return text if s == "ok" else (s or "-")


def markdown_chunk(result: dict) -> str:
    pipes = result.get("pipelines") or ["default"]
    head = ["gate", "shape", "floor GiB", "kdakit fwd / fwd+bwd ms", "FLA fwd / fwd+bwd ms", "fwd ratio",
            "fwd+bwd ratio", "kdakit peak alloc (reserved) GiB", "FLA peak alloc (reserved) GiB", "peak ratio",
            "kdakit pipeline ran"]
    for p in pipes[1:]:
        head += [f"{p} fwd / fwd+bwd ms", f"{p} fwd+bwd ratio", f"{p} peak alloc (reserved) GiB"]
    align = ["---", "---"] + ["---:"] * 8 + ["---"] + ["---:"] * (len(head) - 11)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in result["rows"]:
        cells = [r["gate"], r["shape"], _f(r.get("floor_gib"), ".3f"),
                 _status_or(r, "kdakit", _pair(r, "kdakit_fwd_ms", "kdakit_fwd_bwd_ms", ".2f")),
                 _status_or(r, "fla", _pair(r, "fla_fwd_ms", "fla_fwd_bwd_ms", ".2f")),
                 _f(r.get("fwd_ratio"), ".2f") + ("x" if r.get("fwd_ratio") is not None else ""),
                 _f(r.get("fwd_bwd_ratio"), ".2f") + ("x" if r.get("fwd_bwd_ratio") is not None else ""),
                 _status_or(r, "kdakit", f"{_f(r.get('kdakit_peak_alloc_gib'), '.3f')} "
                                         f"({_f(r.get('kdakit_peak_reserved_gib'), '.3f')})"),
                 _status_or(r, "fla", f"{_f(r.get('fla_peak_alloc_gib'), '.3f')} "
                                      f"({_f(r.get('fla_peak_reserved_gib'), '.3f')})"),
                 _f(r.get("peak_ratio"), ".2f") + ("x" if r.get("peak_ratio") is not None else ""),
                 str(r.get("kdakit_pipeline_ran") or "-")]
        for p in pipes[1:]:
            pre = f"kdakit_{p}"
            ratio = r.get(f"fwd_bwd_ratio_{p}")
            cells += [_status_or(r, pre, _pair(r, f"{pre}_fwd_ms", f"{pre}_fwd_bwd_ms", ".2f")),
                      _f(ratio, ".2f") + ("x" if ratio is not None else ""),
                      _status_or(r, pre, f"{_f(r.get(f'{pre}_peak_alloc_gib'), '.3f')} "
                                         f"({_f(r.get(f'{pre}_peak_reserved_gib'), '.3f')})")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_layer(result: dict) -> str:
    pipes = result.get("pipelines") or ["default"]
    head = ["shape", "kdakit fwd / fwd+bwd ms", "FLA fwd / fwd+bwd ms", "fwd+bwd ratio",
            "kdakit peak above weights+input (reserved) GiB", "FLA peak above weights+input (reserved) GiB"]
    for p in pipes[1:]:
        head += [f"{p} fwd / fwd+bwd ms", f"{p} fwd+bwd ratio", f"{p} peak (reserved) GiB"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in result["rows"]:
        cells = [r["shape"], _status_or(r, "kdakit", _pair(r, "kdakit_fwd_ms", "kdakit_fwd_bwd_ms", ".2f")),
                 _status_or(r, "fla", _pair(r, "fla_fwd_ms", "fla_fwd_bwd_ms", ".2f")),
                 _f(r.get("fwd_bwd_ratio"), ".2f") + ("x" if r.get("fwd_bwd_ratio") is not None else ""),
                 _status_or(r, "kdakit", f"{_f(r.get('kdakit_peak_alloc_gib'), '.3f')} "
                                         f"({_f(r.get('kdakit_peak_reserved_gib'), '.3f')})"),
                 _status_or(r, "fla", f"{_f(r.get('fla_peak_alloc_gib'), '.3f')} "
                                      f"({_f(r.get('fla_peak_reserved_gib'), '.3f')})")]
        for p in pipes[1:]:
            pre = f"kdakit_{p}"
            ratio = r.get(f"fwd_bwd_ratio_{p}")
            cells += [_status_or(r, pre, _pair(r, f"{pre}_fwd_ms", f"{pre}_fwd_bwd_ms", ".2f")),
                      _f(ratio, ".2f") + ("x" if ratio is not None else ""),
                      _status_or(r, pre, f"{_f(r.get(f'{pre}_peak_alloc_gib'), '.3f')} "
                                         f"({_f(r.get(f'{pre}_peak_reserved_gib'), '.3f')})")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    return markdown_layer(result) if result.get("kind") == "layer" else markdown_chunk(result)


def merge(results: list[dict]) -> dict:
    """Join result files of the same kind (e.g. two device calls over different gates): records concatenated and
    rows rebuilt (an ok record wins), pipelines in first-seen order; the provenance of each file is kept."""
    if not results:
        raise ValueError("merge: expected at least one result, got none")
    kinds = {r.get("kind") for r in results}
    if len(kinds) != 1:
        raise ValueError(f"merge: expected results of one kind, got {sorted(map(str, kinds))}")
    out = dict(results[0])
    pipes: list[str] = []
    records: list[dict] = []
    for r in results:
        for p in r.get("pipelines") or []:
            if p not in pipes:
                pipes.append(p)
        records += r.get("records", [])
    shas = sorted({str(r.get("kdakit", {}).get("git_sha")) for r in results})
    out.update(pipelines=pipes, records=records, merged_from=[
        {k: r.get(k) for k in ("date", "gpu", "process", "selection", "interrupted")}
        | {"git_sha": r.get("kdakit", {}).get("git_sha")} for r in results])
    if len(shas) > 1:
        out["git_sha_mismatch"] = shas
    out["rows"] = build_rows(records, pipes, out.get("kind", "chunk"))
    out["markdown"] = markdown(out)
    return out


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def impl_keys(impls: list[str], pipelines: list[str]) -> list[str]:
    out = []
    if "kdakit" in impls:
        out += [f"kdakit:{p}" for p in pipelines]
    if "fla" in impls:
        out.append("fla")
    return out


def plan_jobs(cells: list[tuple], keys: list[str], process: str) -> list[tuple]:
    """(cell, [impl keys]) per measuring process, cells in the order given, kdakit before FLA."""
    jobs = []
    for cell in cells:
        if process == "fresh":
            jobs += [(cell, [k]) for k in keys]
        elif process == "split":
            kd = [k for k in keys if k != "fla"]
            jobs += [(cell, kd)] if kd else []
            jobs += [(cell, ["fla"])] if "fla" in keys else []
        else:
            jobs.append((cell, list(keys)))
    return jobs


def warm_cells(kind: str, cells: list[tuple]) -> list[tuple]:
    """Small cells with the kernel variants of ``cells``: per (gate, MBS, H) MBS sequences of 1024 / MBS tokens
    (the sequence count and head count are what FLA's and kdakit's compiled variants depend on)."""
    if kind == "layer":
        return [(None, "1x1024")]
    out, seen = [], set()
    for gate, shape in cells:
        mbs, _, H = parse_shape(shape)
        if (gate, mbs, H) not in seen:
            seen.add((gate, mbs, H))
            out.append((gate, f"{mbs}x{max(64, 1024 // mbs)}:{H}"))
    return out
