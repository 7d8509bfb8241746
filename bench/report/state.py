"""Items 5 and 6: the commit's cost (its parts, over a stretch of commits with the votes batched
or not) and the state's sync, snapshot, checkpoint and restore."""

from __future__ import annotations

from typing import Any

from bench.report.common import Check, fixed, met_text, mib_per_s, ms, size, table


def section(item: dict[str, Any]) -> list[str]:
    rows = []
    for model in item["models"]:
        rows.append(
            [
                f"{model['params']:,}",
                size(model["state_bytes"]),
                ms(model["step_s"]),
                ms(model["commit_s"]),
                " / ".join(ms(model.get("commit_parts_s", {}).get(k)) for k in COMMIT_PARTS),
                f"{model['commit_share']:.1%}",
                fixed(model["sync_first_s"]),
                fixed(model["sync_warm_s"]),
                fixed(model["sync_bound_s"]),
            ]
        )
    return [
        "## 5 and 6. Commit cost and state sync",
        "",
        f"{item['what']}; a commit every {item['commit_every']} steps. Share = commit / (commit + "
        f"{item['commit_every']} steps). Sync = State.sync() on rank 0 after a barrier; bound = "
        f"state bytes / loopback bandwidth ({mib_per_s(item['loopback_Bps'])} MiB/s, this run). "
        "Parts of a commit, each timed alone after a barrier: the in-memory save, rank 0's "
        "progress report to etcd, the host-update check (a broadcast among the ranks).",
        "",
        *table(
            [
                "parameters",
                "state (weights + Adam slots)",
                "step ms",
                "commit ms",
                "parts ms: save / report / check",
                "commit share",
                "sync s (fresh ring)",
                "sync s (warm)",
                "bound S/B s",
            ],
            rows,
        ),
        "",
        *_commit_means(item),
        *_state_stores(item),
    ]


def _commit_means(item: dict[str, Any]) -> list[str]:
    """Item 5's commit cost over a stretch of commits, votes at every commit vs batched (none
    for results measured before the votes were batched)."""
    models = [model for model in item["models"] if model.get("commit_mean_s")]
    if not models:
        return []
    rows = [
        [
            f"{model['params']:,}",
            *(
                f"{ms(model['commit_mean_s'][k])} ({model['commit_mean_share'][k]:.1%})"
                for k in ("every_commit", "batched")
            ),
        ]
        for model in models
    ]
    target = item.get("commit_target_share", 0.02)
    return [
        "The commit as training sees it: the mean over a stretch of commits, each timed where the "
        "loop commits (a host-update vote's wait for the slower rank included), with the votes "
        "at every commit (as before they were batched) and batched (the default: about every "
        "0.5 s, `ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL`); ms (share of a commit interval).",
        "",
        *table(["parameters", "votes at every commit", "votes batched"], rows),
        "",
        f"Target: <= {target:.0%} of the commit interval at ~1 M parameters, batched: "
        f"{met_text(item.get('commit_met'))}.",
        "",
    ]


COMMIT_PARTS = ("save", "report", "check")


#: Where a commit is loaded back from: restore_s's keys, as the table shows them.
RESTORES = ("snapshot", "checkpoint_cold", "checkpoint_warm")


def _state_stores(item: dict[str, Any]) -> list[str]:
    """Item 5's second table: the commit kept outside the process (a shared-memory snapshot, a
    checkpoint on disk) and loaded back, next to the peer broadcast; none for results measured
    before these figures were."""
    models = [model for model in item["models"] if "restore_s" in model]
    if not models:
        return []
    rows = []
    problems = []
    for model in models:
        restore = model["restore_s"]
        rows.append(
            [
                f"{model['params']:,}",
                ms(model["commit_snapshots_off_s"]),
                ms(model["commit_snapshots_on_s"]),
                ms(model["snapshot_write_s"]),
                ms(model["checkpoint_write_s"]),
                ms(restore.get("snapshot")),
                " / ".join(ms(restore.get(k)) for k in RESTORES[1:]),
                " / ".join(ms(model[k]) for k in ("sync_first_s", "sync_warm_s")),
            ]
        )
        problems += [f"- {model['params']:,} parameters: {p}" for p in model["store_problems"]]
    rounds = item.get("store_rounds")
    return [
        "Keeping the commit outside the process, and loading it back (ms; medians of "
        f"{rounds if rounds is not None else 'a few'} rounds per model, each part after a "
        "barrier). Commit: `State.commit()` with the slot's shared-memory snapshot off (the "
        "State's writer detached) and on (the writer idle at the start): the snapshot's cost on "
        "the critical path. Snapshot write: from the commit's hand-off to the writer thread "
        "until it is written (in the background; every rank writes its own at once). "
        "Checkpoint write: `CheckpointDir.write` of the committed state, rank 0 alone, fsynced, "
        f"to a folder on {item.get('checkpoint_filesystem', 'disk')}. Restore: rank 0 alone "
        "loads the commit into the model (`state_snapshots.load_newest` with one source: read, "
        "checked, assigned, committed in memory) from the snapshot, and from the checkpoint "
        "with its files dropped from the page cache first (cold; a virtual machine's host may "
        "still cache its disk) and again (warm); the peer broadcast is the sync above at 2 "
        "ranks. The snapshot needs room in /dev/shm for two copies of the state per rank "
        "while a new one replaces the last.",
        "",
        *table(
            [
                "parameters",
                "commit ms, snapshot off",
                "commit ms, snapshot on",
                "snapshot write ms (background)",
                "checkpoint write ms",
                "restore ms: snapshot",
                "restore ms: checkpoint cold / warm",
                "restore ms: broadcast fresh / warm",
            ],
            rows,
        ),
        "",
        *([*problems, ""] if problems else []),
    ]


def check(state: dict[str, Any]) -> list[Check]:
    """Item 5's row of the targets: the batched commit's share at ~1 M parameters."""
    if state.get("commit_met") is None:
        return []
    smallest = state["models"][0]
    shares = smallest["commit_mean_share"]
    figure = (
        f"{shares['batched']:.1%} of the commit interval at {smallest['params']:,} parameters "
        f"(votes at every commit: {shares['every_commit']:.1%}) vs <= "
        f"{state['commit_target_share']:.0%}"
    )
    return [("commit", "5. commit cost", state["commit_met"], figure)]
