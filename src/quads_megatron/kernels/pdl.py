"""Programmatic dependent launch (PDL, sm_90+) for the MoE kernels' launch chain.

A kernel launched with PDL may start while the kernel before it in the stream still runs, once every
CTA of that one has signalled ``griddepcontrol.launch_dependents`` (or exited): its CTA launch and
set-up overlap the previous kernel's tail. The rule every kernel of ours follows, so that any order of
them (and of foreign kernels) stays correct:

* ``griddepcontrol.wait`` first, before any global read: it returns once the previous kernel has
  completed and its writes are visible (at once where the launch was not programmatic);
* then ``griddepcontrol.launch_dependents``: the next kernel may start its CTAs (which wait in turn).

So nothing is read early; what overlaps is launch latency and CTA start. Both instructions are no-ops
without PDL. Off on the CPU interpreter, below sm_90, and with QUADS_PDL=0 in the environment.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never enabled (the PDL branch is never compiled)
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on device are launched with PDL (CUDA sm_90+, a Triton with grid dependency
    control, not interpreted, QUADS_PDL != 0)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1" or gdc_wait is None:
        return False
    if os.environ.get("QUADS_PDL", "1") == "0":
        return False
    return _sm90_or_later(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Launch keywords of a kernel with a PDL constexpr: the constexpr and the launch flag together
    (a kernel launched with PDL must wait before its first read)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """At a Triton kernel's start: wait for the previous kernel's writes, then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
