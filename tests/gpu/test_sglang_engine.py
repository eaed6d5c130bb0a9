"""The real stack on a GPU: a `quads convert`ed tiny Qwen3-MoE served by a real SGLang Engine with
quantization="quads_nvfp4" (CUDA graphs on) in three modes, dynamic RAC 50% (the default), static RAC
plans with static input scales (calibrated from a bf16 transformers forward), and RAC off; a bf16 Engine
of the same HF weights; and the README's `python -m sglang.launch_server` command over HTTP.

Each engine runs once per module in its own process (engine_worker.py: SGLang's signal handlers kill
their whole process tree when a child fails, which must not take pytest with it) and is shut down
before the next starts. The torch reference of the same math (engine_ref.py) is HF transformers'
Qwen3MoeForCausalLM on the GPU with moe_w4a4(impl="reference") on the converted tensors.

Tolerance: logprobs of a forced sequence (prompt + the bf16 reference's greedy continuation) are
compared position by position. Engine and reference differ in attention, norm and GEMM kernels, and
rounding activations to 4 bits amplifies such differences (2026-12-05: the same change of attention
kernel moves bf16 logprobs by ~0.045 and NVFP4 ones by ~0.13-0.19). So each mode's floor is measured:
the gap between its reference and the same reference with transformers' eager attention instead of SDPA.
The bf16 engine must stay within half the distance between the reference's own modes (the smallest
change of the math this test must tell apart); its gap over the bf16 floor is the engine's kernel
difference in units of that perturbation (k, at least 1). A quantized engine must stay within
MARGIN * k * floor of its mode, and be closer to its mode's reference than to any other mode's. What
logprobs cannot resolve, the kernels' bit-exactness against the reference, is tested by test_gpu_cuda.py.

Run on a GPU (H100, 2026-12-05: ~7.5 min without the server test, ~4 min for it alone; 5 engine starts and a server):
TRITON_INTERPRET=0 pytest -s -rA tests/gpu/test_sglang_engine.py
(OUT=<dir> also writes sglang_engine.json there). Skips without CUDA, SGLang or transformers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 device run)"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang (0.5.17 on the device)"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
]

import engine_ref as er  # noqa: E402
import engine_worker as ew  # noqa: E402
from tiny_moe import qwen3_moe_config, write_checkpoint  # noqa: E402

CFG = qwen3_moe_config(hidden=512, moe_inter=256, experts=16, topk=4, layers=4, vocab=1024)
BATCH, PROMPT, NEW = 16, 16, 24
ENGINE_TIMEOUT_S, SERVER_TIMEOUT_S = 300, 300
PREFILL_GRAPH_TOKENS = 1024  # prefill graphs up to the forced batch's 640 tokens: fewer captures at start
LOADER = "quads_megatron.integrations.sglang.load_weights"
#: a quantized engine's gap to its reference may exceed the expected floor (k * its mode's floor) by this
MARGIN = 1.5
REPORT: dict = {}
#: engine and server processes running now (each the leader of a new process group: stopped as a group)
LIVE: set[subprocess.Popen] = set()


@pytest.fixture(scope="module", autouse=True)
def stop_children_on_sigterm():
    """A timeout around pytest (SIGTERM) stops the engine or server it started, then the whole pytest run
    (pytest.exit: a SystemExit raised inside a test would only fail that test and go on to the next)."""

    def stop(signum, frame):
        for proc in list(LIVE):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.exit(f"stopped by signal {signum}", returncode=128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    yield
    signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def step(name: str):
    """One PASS/FAIL line per step (pytest -s shows them); details go to REPORT[name]."""
    details = REPORT.setdefault(name, {})
    try:
        yield details
    except BaseException as e:
        details["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        raise
    finally:
        write_report()
    print(f"PASS {name}: {json.dumps(details, default=float)[:600]}", flush=True)


def write_report() -> None:
    """REPORT as OUT/sglang_engine.json (after every step: a run cut short keeps what it measured)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "sglang_engine.json"), "w") as f:
            json.dump(REPORT, f, indent=1, default=float)


def child_env() -> dict:
    """Environment of the engine and server processes: Triton compiled (the CPU tests' conftest turns
    its interpreter on)."""
    return dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")


def engine_kwargs(path: str, quantized: bool) -> dict:
    kw = dict(
        model_path=path,
        skip_tokenizer_init=True,
        attention_backend="triton",
        sampling_backend="pytorch",
        grammar_backend="none",
        mem_fraction_static=0.2,
        cuda_graph_max_bs_decode=BATCH,
        cuda_graph_max_bs_prefill=PREFILL_GRAPH_TOKENS,
        disable_cuda_graph=False,
        disable_radix_cache=True,
        random_seed=0,
        log_level="warning",
    )
    if quantized:
        kw.update(quantization="quads_nvfp4", custom_weight_loader=[LOADER])
    return kw


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang_engine")


@pytest.fixture(scope="module")
def ckpts(root) -> dict[str, str]:
    """bf16 HF checkpoint, converted once per mode (static after calibration, in `ref`)."""
    with step("checkpoints") as d:
        t0 = time.time()
        paths = {"bf16": write_checkpoint(root / "bf16", CFG, seed=0)}
        for mode in ("dynamic", "off"):
            paths[mode] = str(root / mode)
            er.convert(paths["bf16"], paths[mode], mode)
        assert er.quads_block(paths["dynamic"]) == {}  # the method's default: dynamic RAC 50%
        assert er.quads_block(paths["off"])["rollout"]["rac"]["enabled"] is False
        d["seconds"] = time.time() - t0
    return paths


class Reference:
    """HF transformers on the GPU: bf16 greedy continuations (the forced sequences), calibration and the
    static checkpoint, greedy tokens / forced logprobs per mode (cached), and per mode the forced logprobs
    of the perturbed reference (eager attention) that give the mode's floor."""

    def __init__(self, root: Path, ckpts: dict[str, str]) -> None:
        self.ckpts = ckpts
        self.model = er.load_model(ckpts["bf16"], "cuda")
        self.perturbed = er.load_model(ckpts["bf16"], "cuda", attention="eager")
        g = torch.Generator().manual_seed(1234)
        self.prompts = torch.randint(0, CFG["vocab_size"], (BATCH, PROMPT), generator=g).cuda()
        self.results: dict[str, dict] = {}
        self.perturbed_logprobs: dict[str, torch.Tensor] = {}
        for model in (self.model, self.perturbed):
            er.patch_moe(model, er.Bf16Experts(model))
        cont = er.greedy(self.model, self.prompts, NEW)
        self.forced = torch.cat([self.prompts, cont], dim=1)
        self.results["bf16"] = {"greedy": cont.cpu(), "logprobs": er.token_logprobs(self.model, self.forced).cpu()}
        extra = torch.randint(0, CFG["vocab_size"], self.forced.shape, generator=g).cuda()
        calib = er.calibrate(self.model, torch.cat([self.forced, extra]), str(root / "calib"))
        ckpts["static"] = str(root / "static")
        er.convert(ckpts["bf16"], ckpts["static"], "static", calib)

    def _experts(self, model, mode: str):
        if mode == "bf16":
            return er.Bf16Experts(model)
        return er.W4A4Experts(self.ckpts[mode], CFG["num_hidden_layers"], CFG["num_experts"], "cuda")

    def mode(self, mode: str) -> dict:
        if mode not in self.results:
            er.patch_moe(self.model, self._experts(self.model, mode))
            try:
                self.results[mode] = {
                    "greedy": er.greedy(self.model, self.prompts, NEW).cpu(),
                    "logprobs": er.token_logprobs(self.model, self.forced).cpu(),
                }
            finally:
                er.patch_moe(self.model, er.Bf16Experts(self.model))
        return self.results[mode]

    def floor(self, mode: str) -> float:
        """Mean logprob gap between this mode's reference and the same mode with eager attention."""
        if mode not in self.perturbed_logprobs:
            er.patch_moe(self.perturbed, self._experts(self.perturbed, mode))
            try:
                self.perturbed_logprobs[mode] = er.token_logprobs(self.perturbed, self.forced).cpu()
            finally:
                er.patch_moe(self.perturbed, er.Bf16Experts(self.perturbed))
        return er.gap(self.mode(mode)["logprobs"], self.perturbed_logprobs[mode])["mean"]

    def separation(self, mode: str) -> float:
        """Mean logprob gap from this mode's reference to the nearest other mode's (bf16 included)."""
        others = [m for m in ("bf16", *er.MODES) if m != mode]
        return min(er.gap(self.mode(mode)["logprobs"], self.mode(m)["logprobs"])["mean"] for m in others)


@pytest.fixture(scope="module")
def ref(root, ckpts) -> Reference:
    with step("reference") as d:
        t0 = time.time()
        r = Reference(root, ckpts)
        static = er.quads_block(ckpts["static"])
        assert static["rollout"]["activation_scale"] == "static" and static["rollout"]["rac"]["selection"] == "static"
        assert len(static["rac_plans"]) == CFG["num_hidden_layers"]
        d["seconds"] = time.time() - t0
    return r


class Engines:
    """One engine_worker process per mode, started on first use and finished (engine shut down) before
    the next starts."""

    def __init__(self, root: Path, ckpts: dict[str, str], ref: Reference) -> None:
        self.root, self.ckpts, self.ref, self.out = root, ckpts, ref, {}

    def get(self, mode: str) -> dict:
        if mode not in self.out:
            self.out[mode] = self._run(mode)
        res = self.out[mode]
        if not res.get("ok"):
            pytest.fail(f"engine {mode} failed: {res.get('error')}\n{res.get('log', '')}")
        return res

    def _run(self, mode: str) -> dict:
        spec = {
            "engine": engine_kwargs(self.ckpts[mode], quantized=mode != "bf16"),
            "prompts": self.ref.prompts.tolist(),
            "forced": self.ref.forced.tolist(),
            "new_tokens": NEW,
            "vocab_size": CFG["vocab_size"],
        }
        spec_path, out_path, log_path = (self.root / f"engine_{mode}.{s}" for s in ("spec.json", "out.json", "log"))
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(ew.__file__)), str(spec_path), str(out_path)]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), process_group=0)
            LIVE.add(proc)
            try:
                proc.wait(timeout=ENGINE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                stop_group(proc)
                return {"ok": False, "error": f"timed out after {ENGINE_TIMEOUT_S} s", "log": tail(log_path)}
            finally:
                LIVE.discard(proc)
        if not out_path.exists():
            return {"ok": False, "error": f"worker exited {proc.returncode} without output", "log": tail(log_path)}
        res = json.loads(out_path.read_text())
        if not res.get("ok"):
            res["log"] = res.get("traceback", "") + "\n" + tail(log_path)
        return res


@pytest.fixture(scope="module")
def engines(root, ckpts, ref) -> Engines:
    return Engines(root, ckpts, ref)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group this test started (process_group=0), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


# ----------------------------------------------------------------------------- tests


def check_engine_output(res: dict) -> None:
    greedy, lp = res["greedy"], res["forced_logprobs"]
    assert len(greedy) == BATCH and all(len(g) == NEW for g in greedy)
    assert all(0 <= t < CFG["vocab_size"] for g in greedy for t in g)
    assert torch.isfinite(torch.tensor(lp)).all() and torch.isfinite(torch.tensor(res["greedy_logprobs"])).all()
    assert ew.decode_graph_captured(res["graph"]), f"no decode CUDA graph captured: {res['graph']}"


def kernel_difference(engines, ref) -> float:
    """k: the bf16 engine's gap to the bf16 reference over the bf16 floor, at least 1 (the engine's
    non-expert kernels differ from transformers' by k times what eager vs SDPA attention changes)."""
    gap = er.gap(engines.get("bf16")["forced_logprobs"], ref.mode("bf16")["logprobs"])["mean"]
    return max(1.0, gap / ref.floor("bf16"))


def test_bf16_engine_matches_bf16_reference(engines, ref):
    """The floor: kernel differences alone (SGLang's attention, norms and fused MoE vs transformers)."""
    with step("bf16 engine vs bf16 reference") as d:
        res = engines.get("bf16")
        check_engine_output(res)
        gap = er.gap(res["forced_logprobs"], ref.mode("bf16")["logprobs"])
        d.update(gap=gap, greedy=er.agreement(res["greedy"], ref.mode("bf16")["greedy"]), startup_s=res["startup_s"])
        d.update(floor=ref.floor("bf16"), k=kernel_difference(engines, ref))
        d["tolerance"] = 0.5 * ref.separation("bf16")
        assert gap["mean"] <= d["tolerance"], d


@pytest.mark.parametrize("mode", er.MODES)
def test_quads_engine_matches_reference(engines, ref, mode):
    """W4A4 engine vs its torch reference (same NVFP4 tensors, RAC and scales) and vs the bf16 engine."""
    with step(f"quads_nvfp4 engine ({mode}) vs reference") as d:
        res = engines.get(mode)
        check_engine_output(res)
        bf16 = engines.get("bf16")
        d["vs_bf16_engine"] = {
            "logprob_gap": er.gap(res["forced_logprobs"], bf16["forced_logprobs"]),
            "greedy": er.agreement(res["greedy"], bf16["greedy"]),
        }
        gaps = {m: er.gap(res["forced_logprobs"], ref.mode(m)["logprobs"]) for m in ("bf16", *er.MODES)}
        d["vs_reference"] = {"logprob_gap": gaps[mode], "greedy": er.agreement(res["greedy"], ref.mode(mode)["greedy"])}
        d["gap_to_other_references"] = {m: g["mean"] for m, g in gaps.items() if m != mode}
        d.update(floor=ref.floor(mode), k=kernel_difference(engines, ref), separation=ref.separation(mode))
        d["tolerance"] = MARGIN * d["k"] * d["floor"]
        d.update(startup_s=res["startup_s"], graph=res["graph"])
        assert gaps[mode]["mean"] <= d["tolerance"], d
        nearest = min(gaps, key=lambda m: gaps[m]["mean"])
        assert nearest == mode, f"engine ({mode}) is closest to the {nearest} reference: {d}"


def test_rac_on_closer_to_bf16_than_off(engines, ref):
    """Mean logprob gap to the bf16 engine: dynamic RAC 50% below RAC off. Static RAC (with static scales)
    must keep the reference's order where the reference separates it from RAC off by > 10% (a smaller margin
    is within what the engine's kernel differences can move)."""
    with step("RAC on closer to bf16 than RAC off") as d:
        bf16 = engines.get("bf16")["forced_logprobs"]
        eng = {m: er.gap(engines.get(m)["forced_logprobs"], bf16)["mean"] for m in er.MODES}
        refg = {m: er.gap(ref.mode(m)["logprobs"], ref.mode("bf16")["logprobs"])["mean"] for m in er.MODES}
        d.update(engine_gap_to_bf16=eng, reference_gap_to_bf16=refg)
        assert eng["dynamic"] < eng["off"], d
        if refg["static"] < 0.9 * refg["off"]:
            assert eng["static"] < eng["off"], d


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            with urllib.request.urlopen(url + "/health_generate", timeout=10) as r:
                if r.status == 200:
                    return time.time() - t0
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout} s")


def test_launch_server_readme_command(root, ckpts, engines, ref):
    """README's server command for real: health, one /generate with input_ids, the same greedy tokens as
    the Engine of the same checkpoint and settings (batch of one)."""
    from helpers import free_port

    with step("launch_server (README command)") as d:
        want = engines.get("dynamic")["single"]
        port = free_port()
        cmd = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", ckpts["dynamic"],
            "--quantization", "quads_nvfp4", "--custom-weight-loader", LOADER,
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--mem-fraction-static", "0.2", "--cuda-graph-max-bs-decode", str(BATCH),
            "--cuda-graph-max-bs-prefill", str(PREFILL_GRAPH_TOKENS), "--disable-radix-cache",
            "--random-seed", "0",
        ]  # fmt: skip
        d["command"] = " ".join(cmd[1:])
        log_path = root / "server.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), process_group=0)
        LIVE.add(proc)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                d["healthy_after_s"] = wait_healthy(url, proc, SERVER_TIMEOUT_S)
            except (RuntimeError, TimeoutError) as e:
                raise AssertionError(f"{e}\n{tail(log_path)}") from e
            body = {
                "input_ids": ref.prompts[0].tolist(),
                "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True},
                "return_logprob": True,
            }
            req = urllib.request.Request(
                url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                out = json.loads(r.read())
            got = out["output_ids"]
            lps = ew.output_logprobs(out["meta_info"])
            d.update(output_ids=got, same_as_engine=got == want)
            assert len(got) == NEW and all(0 <= t < CFG["vocab_size"] for t in got)
            assert len(lps) == NEW and torch.isfinite(torch.tensor(lps)).all()
            assert got == want, f"server {got} != engine {want}"
        finally:
            stop_group(proc)
            LIVE.discard(proc)
        d["exit_code"] = proc.returncode
