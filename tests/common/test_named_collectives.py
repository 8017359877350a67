"""common.distributed.all_reduce_named: named sums and per-rank slots, one process and 2 real gloo ranks."""
import json
import subprocess
import sys
import textwrap

import torch

from dit_pipeline.common import distributed as dist
from tests._util import cli_env, free_port


def test_one_process_returns_the_values_by_name():
    out = dist.all_reduce_named({"b": 2.5, "a": torch.tensor(1.25, dtype=torch.float64)},
                                per_rank={"nan": 1.0, "ok": 0.0})
    assert (out["a"], out["b"]) == (1.25, 2.5)
    assert out.ranks_with("nan") == [0] and out.ranks_with("ok") == []
    assert dist.all_reduce_named({}).sums == {}


def test_two_ranks_sum_by_name_whatever_the_dict_order(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        from dit_pipeline.common import distributed as dist
        dist.init()
        with dist.leaving_group():  # the commands' ending: a barrier, then destroy (a hang at torch 2.6 without)
            r = dist.rank()
            vals = {"loss": 1.5 + r, "wait": 10.0 * r} if r == 0 else {"wait": 10.0 * r, "loss": 1.5 + r}
            out = dist.all_reduce_named(vals, per_rank={"bad": float(r == 1), "err": 0.0})
            with open(sys.argv[1] + f".{r}", "w") as f:
                json.dump({"sums": out.sums, "bad": out.ranks_with("bad"), "err": out.ranks_with("err")}, f)
        assert not dist.is_initialized()
    """))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script),
                          str(tmp_path / "out")], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    for r in range(2):
        got = json.loads((tmp_path / f"out.{r}").read_text())
        assert got == {"sums": {"loss": 4.0, "wait": 10.0}, "bad": [1], "err": []}


def test_leaving_after_a_peer_failed_does_not_wait_for_it(tmp_path):
    """common.distributed.leaving_group: a rank that raises leaves at once, and a rank that finished normally
    then finds its peer gone at the ending barrier and leaves too (no wait for the collective timeout)."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import sys
        from dit_pipeline.common import distributed as dist
        dist.init()
        try:
            with dist.leaving_group():
                if dist.rank() == 1:
                    raise ValueError("rank 1 fails")
        except ValueError:
            sys.exit(3)
        assert not dist.is_initialized()
        open(sys.argv[1], "w").write("rank 0 left")
    """))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script),
                          str(tmp_path / "out")], capture_output=True, text=True,
                         env=cli_env({"DIT_DIST_TIMEOUT": "600"}), timeout=300)
    assert res.returncode != 0 and "exitcode: 3" in res.stderr and "local_rank: 1" in res.stderr
    assert (tmp_path / "out").read_text() == "rank 0 left"
