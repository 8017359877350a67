"""Launch detection (common/distributed.py): torchrun's variables win, srun's tasks form one job, and an
environment that could make two processes both rank 0 is refused with one line."""
from __future__ import annotations

import pytest

from dit_pipeline.common.distributed import Launch, detect_launch, first_host, srun_port, tasks_on_node
from dit_pipeline.common.errors import UserError


def srun_env(rank: int = 1, **over: str) -> dict[str, str]:
    """What srun gives task `rank` of a 4-task step over 2 nodes of job 4242 (2 tasks per node)."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2),
           "SLURM_NODEID": str(rank // 2), "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NNODES": "2",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_JOB_NODELIST": "gpu[007-008]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5"}
    env.update(over)
    return {k: v for k, v in env.items() if v != "-"}


@pytest.mark.parametrize("nodelist, first", [("gpu[003-005,9],cpu1", "gpu003"), ("r[1-2]n[07-08]", "r1n07"),
                                             ("node7", "node7"), ("a1,b[1-3]", "a1"), ("x[9,3-4]", "x9")])
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


def test_tasks_on_node_expands_the_compressed_list():
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert tasks_on_node("8", 0) == 8


def test_srun_tasks_form_one_job():
    port = srun_port(4242, 3)
    assert [detect_launch(srun_env(r)) for r in range(4)] == [
        Launch("srun", r, 4, r % 2, 2, "gpu007", port) for r in range(4)]
    assert 15000 <= port < 32000 and port != srun_port(4242, 4) and port != srun_port(4243, 3)
    assert detect_launch(srun_env(1)).describe() == (f"launcher: srun, 4 rank(s), 2 on this node, "
                                                     f"rendezvous gpu007:{port}")


def test_master_addr_and_port_override():
    got = detect_launch(srun_env(0, MASTER_ADDR="10.1.1.1", MASTER_PORT="23456"))
    assert (got.master_addr, got.master_port) == ("10.1.1.1", 23456)


def test_one_node_without_a_node_list_uses_the_launch_address():
    env = srun_env(0, SLURM_STEP_NODELIST="-", SLURM_JOB_NODELIST="-", SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1",
                   SLURM_STEP_TASKS_PER_NODE="4")
    assert detect_launch(env) == Launch("srun", 0, 4, 0, 4, "10.0.0.5", srun_port(4242, 3))


def test_torchrun_variables_win_over_slurm():
    env = srun_env(1, WORLD_SIZE="16", RANK="9", LOCAL_RANK="1", LOCAL_WORLD_SIZE="8", MASTER_ADDR="h",
                   MASTER_PORT="29500", TORCHELASTIC_RUN_ID="x")
    assert detect_launch(env) == Launch("torchrun", 9, 16, 1, 8, "h", 29500)


def test_single_processes():
    assert detect_launch({}) == Launch()
    assert detect_launch(srun_env(0, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1")) == Launch()
    assert detect_launch({"WORLD_SIZE": "1", "RANK": "0"}) == Launch()
    assert Launch().describe() == "launcher: none (one process)"


def test_a_multi_task_allocation_not_started_by_srun_is_refused():
    env = srun_env(0, SLURM_STEP_ID="-", SLURM_STEP_NUM_TASKS="-")  # e.g. dit-train typed in the batch script
    with pytest.raises(UserError) as e:
        detect_launch(env)
    assert str(e.value) == (
        "this process runs in a Slurm allocation of 4 tasks (SLURM_NTASKS) but srun did not start it, so it cannot "
        "know its rank: launch one task per GPU with `srun dit-... ARGS` (e.g. sbatch --ntasks-per-node=GPUS), or "
        "one task per node running `torchrun --nproc-per-node GPUS $(which dit-...) ARGS`; for one process, set "
        "SLURM_NTASKS=1")


def test_an_srun_step_without_a_way_to_rank_0_is_refused():
    env = srun_env(2, SLURM_STEP_NODELIST="-", SLURM_JOB_NODELIST="-")  # 2 nodes, no node list, no MASTER_ADDR
    with pytest.raises(UserError, match=r"^srun started 4 tasks but this one cannot tell how to reach rank 0 "):
        detect_launch(env)
