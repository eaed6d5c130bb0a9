"""One SGLang Engine in its own process, for tests/gpu/test_sglang_engine.py: greedy tokens, logprobs of
forced sequences and evidence of CUDA-graph capture, written as JSON.

    python engine_worker.py SPEC.json OUT.json

SPEC: {"engine": {Engine keyword arguments}, "prompts": [[token ids]], "forced": [[token ids]],
"new_tokens": N}. An own process per engine keeps SGLang's signal handlers (a failing child makes them
kill the whole process tree), exit hooks and GPU memory out of pytest. The parsing helpers are pure.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def output_logprobs(meta: dict) -> list[float]:
    """Logprob of each generated token from a response's meta_info (entries (logprob, id, text))."""
    return [float(e[0]) for e in meta["output_token_logprobs"]]


def reported_ids(ids: list[int], vocab_size: int | None) -> list[int]:
    """ids as SGLang (0.5.17 .. 0.5.23, scheduler's logprob result processor) labels input logprobs: ids >=
    vocab_size - 1 as 0 (meant for multimodal placeholder hashes; the logprob is still the real token's).
    vocab_size None: ids unchanged."""
    return [t if vocab_size is None or t < vocab_size - 1 else 0 for t in ids]


def input_logprobs(meta: dict, seq: list[int], vocab_size: int | None = None) -> list[float]:
    """log p(seq[t] | seq[:t]) for t = 1 .. len(seq)-1 from a response to seq asked with
    logprob_start_len=0: the run of entries whose token ids are seq[1:] (entries may carry one more
    at either end: the first token's None logprob, or the first generated token); ValueError when no
    run of entries matches, naming the first differing position of the best-aligned run.

    vocab_size: ids matched as SGLang labels them (reported_ids)."""
    entries = meta["input_token_logprobs"]
    want = reported_ids(seq[1:], vocab_size)
    if len(entries) < len(want):
        raise ValueError(f"{len(entries)} input logprobs for a sequence of {len(seq)} tokens")
    ids = [int(e[1]) for e in entries]
    for start in range(len(entries) - len(want) + 1):
        if ids[start : start + len(want)] == want:
            return [float(e[0]) for e in entries[start : start + len(want)]]
    first = next((i for i, (a, b) in enumerate(zip(ids[-len(want) :], want, strict=True)) if a != b), None)
    raise ValueError(
        f"input logprob token ids ({len(ids)}) do not contain the sequence ({len(want)} after the first); "
        f"aligned at the end they first differ at position {first}: {ids[-len(want):][first:first + 4]} vs "
        f"{want[first:first + 4]}"
    )


def graph_evidence(info: dict) -> dict:
    """What get_server_info() says about CUDA graphs: the flag, the decode backend, capture seconds and
    graph memory per phase (the scheduler's startup_time.cuda_graph and memory_usage.graph)."""
    states = info.get("internal_states") or [{}]
    state = states[0] if isinstance(states, list) and states else {}
    cfg = state.get("cuda_graph_config") or info.get("cuda_graph_config") or {}
    decode = cfg.get("decode") if isinstance(cfg, dict) else None
    return {
        "disable_cuda_graph": bool(state.get("disable_cuda_graph", info.get("disable_cuda_graph", False))),
        "decode_backend": decode.get("backend") if isinstance(decode, dict) else None,
        "capture_s": ((state.get("startup_time") or info.get("startup_time") or {}).get("cuda_graph")) or {},
        "graph_gb": ((state.get("memory_usage") or {}).get("graph")) or {},
    }


def decode_graph_captured(evidence: dict) -> bool:
    """CUDA graphs on and a decode graph captured (time or memory recorded for the decode phase)."""
    captured = (
        float(evidence["capture_s"].get("decode", 0) or 0) > 0 or float(evidence["graph_gb"].get("decode", 0) or 0) > 0
    )
    return not evidence["disable_cuda_graph"] and evidence["decode_backend"] != "disabled" and captured


def forced_logprobs(meta: dict, seq: list[int], index: int, vocab_size: int | None) -> list[float]:
    """input_logprobs of the index-th forced sequence, its index named in the error."""
    try:
        return input_logprobs(meta, seq, vocab_size)
    except ValueError as e:
        raise ValueError(f"forced sequence {index}: {e}") from None


def run(spec: dict) -> dict:
    from sglang.srt.entrypoints.engine import Engine

    out: dict = {}
    t0 = time.time()
    engine = Engine(**spec["engine"])
    out["startup_s"] = time.time() - t0
    try:
        greedy = {"max_new_tokens": spec["new_tokens"], "temperature": 0.0, "ignore_eos": True}
        res = engine.generate(input_ids=spec["prompts"], sampling_params=greedy, return_logprob=True)
        out["greedy"] = [r["output_ids"] for r in res]
        out["greedy_logprobs"] = [output_logprobs(r["meta_info"]) for r in res]
        one = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        res = engine.generate(input_ids=spec["forced"], sampling_params=one, return_logprob=True, logprob_start_len=0)
        out["forced_logprobs"] = [
            forced_logprobs(r["meta_info"], s, i, spec.get("vocab_size"))
            for i, (r, s) in enumerate(zip(res, spec["forced"], strict=True))
        ]
        out["single"] = engine.generate(input_ids=spec["prompts"][0], sampling_params=greedy)["output_ids"]
        out["graph"] = graph_evidence(engine.get_server_info())
        out["seconds"] = time.time() - t0
    finally:
        engine.shutdown()
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: engine_worker.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        out = {"ok": True, **run(spec)}
    except Exception as e:
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    with open(argv[1] + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(argv[1] + ".tmp", argv[1])
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
