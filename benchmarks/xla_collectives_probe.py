"""Which ways of running TP=2 collectives work on XLA's CPU client (torch-xla 2.9, PJRT_DEVICE=CPU)?

Each approach runs in a fresh process (two CPU devices) with a timeout; prints one line per
approach: ok / FAILED with the error's last line. Run in the XLA lane's environment:
    PJRT_DEVICE=CPU python benchmarks/xla_collectives_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PRELUDE = """
import os
os.environ["PJRT_DEVICE"] = "CPU"; os.environ["CPU_NUM_DEVICES"] = "2"
import numpy as np, torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.runtime as xr
"""

APPROACHES = {
    "threads, one per device, replicated all-reduce (xmp-style)": """
from torch_xla._internal import pjrt
def fn(index=None):
    dev = torch_xla.device()
    xm.set_replication(dev, xm.get_xla_supported_devices())
    t = (torch.arange(4.0) + 10 * xr.global_ordinal()).to(dev)
    s = xm.all_reduce(xm.REDUCE_SUM, t); torch_xla.sync()
    return s.cpu()
print(pjrt.spawn_threads(fn))
""",
    "bf16 all-reduce": """
from torch_xla._internal import pjrt
def fn(index=None):
    dev = torch_xla.device()
    xm.set_replication(dev, xm.get_xla_supported_devices())
    s = xm.all_reduce(xm.REDUCE_SUM, torch.ones(4, dtype=torch.bfloat16).to(dev)); torch_xla.sync()
    return s.cpu()
print(pjrt.spawn_threads(fn))
""",
    "SPMD manual region, xm.all_reduce": """
import torch_xla.distributed.spmd as xs
xr.use_spmd(); mesh = xs.Mesh(np.arange(2), (2,), ("tp",))
x = torch.arange(8.0).reshape(2, 4).to(torch_xla.device())
local = xs.enable_manual_sharding(x, ("tp", None), mesh=mesh).global_tensor
red = xm.all_reduce(xm.REDUCE_SUM, local)
out = xs.disable_manual_sharding(red, ("tp", None), (2, 4), mesh=mesh).global_tensor
got = out.cpu()[0]; want = torch.arange(8.0).reshape(2, 4).sum(0)
assert torch.equal(got, want), f"got {got.tolist()} want {want.tolist()} (the all-reduce was dropped)"
print("ok")
""",
    "SPMD manual region, in-graph fp32 all-reduce + bf16 all-gather (what backends/xla.py does)": """
import torch_xla.distributed.spmd as xs
xr.use_spmd(); mesh = xs.Mesh(np.arange(2), (2,), ("tp",))
x = torch.arange(8.0).reshape(2, 4).to(torch_xla.device())
local = xs.enable_manual_sharding(x, ("tp", None), mesh=mesh).global_tensor[0]
red = torch_xla._XLAC._xla_spmd_all_reduce("sum", local, 1.0, [[0, 1]])
gat = torch_xla._XLAC._xla_all_gather(local.to(torch.bfloat16), 0, 2, [[0, 1]], False, 1, True)
r = xs.disable_manual_sharding(red[None], ("tp", None), (2, 4), mesh=mesh).global_tensor
g = xs.disable_manual_sharding(gat[None], ("tp", None), (2, 8), mesh=mesh).global_tensor
assert torch.equal(r.cpu()[1], torch.tensor([4.0, 6, 8, 10])), r.cpu()
assert torch.equal(g.cpu()[1].float(), torch.arange(8.0)), g.cpu()
print("ok")
""",
}


def main() -> int:
    for name, body in APPROACHES.items():
        code = PRELUDE + textwrap.dedent(body)
        try:
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PJRT_DEVICE": "CPU"})
            lines = [l for l in (run.stdout + run.stderr).splitlines() if l.strip() and "GSPMD" not in l]
            verdict = "ok" if run.returncode == 0 else f"FAILED (exit {run.returncode}): {lines[-1] if lines else ''}"
            if run.returncode != 0:
                stuck = [l for l in lines if "rendezvous" in l.lower()]
                verdict += f" | {stuck[-1][:300]}" if stuck else ""
        except subprocess.TimeoutExpired:
            verdict = "FAILED: no answer within 120 s"
        print(f"{name}: {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
