"""flowgraph.compilers.targets — the strategies a plan runs through (`flowgraph.compilers.target`):

    local.py            one process, every model whole
    fsdp/               N ranks, SPMD, FSDP2: launch, target, multinode
    ray/                a single controller and Ray worker groups: driver, target, worker,
                        calls, cluster
    process_groups.py   what fsdp and ray share: process groups, sharding, slices, rank status
    shared_run_dir.py   proof that every process of a run sees one run dir
"""
