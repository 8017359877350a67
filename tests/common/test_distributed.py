"""common.distributed: single-process fallbacks and a real 2-rank gloo run."""
import json
import subprocess
import sys
import textwrap

import torch

from dit_pipeline.common import distributed as dist
from tests._util import cli_env, free_port


def test_single_process_fallbacks():
    assert not dist.is_initialized()
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (0, 1, True)
    dist.barrier()  # no-op
    t = torch.tensor([1.5, 2.0])
    assert torch.equal(dist.all_reduce_mean(t), t)
    assert dist.broadcast_object({"a": 1}) == {"a": 1}
    assert dist.all_gather_object(3) == [3]
    assert dist.any_true(True) and not dist.any_true(False)


def test_two_rank_gloo(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, torch
        from dit_pipeline.common import distributed as dist
        dist.init()
        r, ws = dist.rank(), dist.world_size()
        out = {
            "rank": r, "ws": ws, "backend": dist.backend(),
            "sum": dist.all_reduce_sum(torch.tensor([float(r + 1)])).tolist(),
            "mean": dist.all_reduce_mean(torch.tensor([float(r)])).tolist(),
            "max": dist.all_reduce_max(torch.tensor([float(r * 10)])).tolist(),
            "any": dist.any_true(r == 1),
            "bcast": dist.broadcast_object({"from": r}),
            "gather": dist.all_gather_object(r * 2),
        }
        t = torch.tensor([float(r + 7)])
        dist.broadcast_tensor_(t, src=1)
        out["bcast_tensor"] = t.tolist()
        dist.barrier()
        with open(sys.argv[1] + f".{r}", "w") as f:
            json.dump(out, f)
        dist.destroy(in_step=True)
    """))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script),
                          str(tmp_path / "out")], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    outs = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    for r, o in enumerate(outs):
        assert o["rank"] == r and o["ws"] == 2 and o["backend"] == "gloo"
        assert o["sum"] == [3.0] and o["mean"] == [0.5] and o["max"] == [10.0]
        assert o["any"] is True
        assert o["bcast"] == {"from": 0}
        assert o["gather"] == [0, 2]
        assert o["bcast_tensor"] == [8.0]


def test_on_rank0_single_process():
    import pytest

    from dit_pipeline.common.errors import UserError

    assert dist.on_rank0(lambda: {"status": "fresh"}) == {"status": "fresh"}

    def refuse():
        raise UserError("OUT holds shards of another config; pass --overwrite")

    with pytest.raises(UserError, match="^OUT holds shards of another config"):
        dist.on_rank0(refuse)
