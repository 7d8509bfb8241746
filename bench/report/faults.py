"""Items 2-4: crash recovery (SIGKILL), hang recovery (SIGSTOP) and scale-up, the cold joiner
and with ``--warm-join``."""

from __future__ import annotations

from typing import Any, Final

from bench.report.common import Check, fixed, met_text, stat, table


def section(item: dict[str, Any]) -> list[str]:
    crash, hang, scaleup = item["crash"], item["hang"], item["scaleup"]
    lines = [
        "## 2. Crash recovery (SIGKILL)",
        "",
        f"{crash['what']}; ~{item['params']:,} parameters. elastic-run: trials in one job of 3 "
        "workers (the killed slot is restarted between trials); horovodrun: elastic mode with a "
        "discovery script and distinct host aliases, a fresh job per trial.",
        "",
        *table(
            ["launcher", "seconds: median (min-max)"],
            [
                ["elastic-run", stat(crash["elastic_run"])],
                ["horovodrun elastic, default Gloo timeout", stat(crash["horovodrun_elastic"])],
                [
                    "horovodrun elastic, HOROVOD_GLOO_TIMEOUT_SECONDS=5",
                    stat(crash["horovodrun_elastic_gloo_timeout_5s"]),
                ],
            ],
        ),
        "",
        f"Target for elastic-run: max <= {crash['target_s']:g} s: {met_text(crash['met'])}.",
        "",
        "## 3. Hang recovery (SIGSTOP)",
        "",
        f"{hang['what']}.",
        "",
        *table(
            ["launcher", "seconds: median (min-max)"],
            [
                ["elastic-run, SIGSTOP", stat(hang["elastic_run"])],
                ["elastic-run, SIGKILL of the same job (item 2)", stat(crash["elastic_run"])],
            ],
        ),
        "",
        _hang_target(hang),
        "",
        "## 4. Scale-up",
        "",
        f"{scaleup['what']}. The new worker is the restarted process of each fault above.",
        "",
        *table(
            ["what", "seconds: median (min-max)"],
            [
                ["ready -> all ranks stepping at the new size", stat(scaleup["elastic_run"])],
                [
                    "registration (before its cold TensorFlow import) -> all stepping",
                    stat(scaleup["from_registration"]),
                ],
                [
                    "pause of the existing ranks (longest gap between two steps)",
                    stat(scaleup["pause"]),
                ],
                ["their normal step interval at size 2", stat(scaleup["step_interval"], " s", 4)],
                *(
                    [f"from ready: {what}", stat(scaleup[key])]
                    for key, what in (
                        ("survivors_reset", "survivors re-initialised (reset callback)"),
                        ("joiner_init", "joiner's hvd.init() returned"),
                        ("joiner_first_step", "joiner's first step (model built, step traced)"),
                    )
                    if key in scaleup
                ),
            ],
        ),
        "",
        f"Targets: scale-up <= {scaleup['target_s']:g} s and pause <= "
        f"{scaleup['pause_target_s']:g} s: {met_text(scaleup['met'])}.",
        "",
        *_warm_scaleup(item.get("scaleup_warm")),
    ]
    return lines


#: The jobs of item 4 with --warm-join, as the report names them.
WARM_JOBS: Final = (("plain", "plain Horovod script + warm_up"), ("ea_state", "ea.State script"))


def _warm_scaleup(warm: dict[str, Any] | None) -> list[str]:
    """Item 4 with --warm-join, next to the cold joiner above (none for older results)."""
    if not warm:
        return []
    parts = [(warm[key], name) for key, name in WARM_JOBS if key in warm]
    rows = [
        [what, *(stat(part.get(key)) for part, _ in parts)]
        for key, what in (
            ("elastic_run", "ready -> all ranks stepping at the new size"),
            ("from_registration", "registration -> all stepping (includes the warm-up)"),
            ("pause", "pause of the existing ranks (longest gap between two steps)"),
            ("survivors_reset", "from ready: survivors re-initialised"),
            ("joiner_first_step", "from ready: joiner's first step in the ring"),
        )
    ]
    return [
        "With `--warm-join`, in two more jobs of the same kind (SIGKILLs only): "
        f"{warm['what']}. The restarted process builds its model and traces its step at a ring "
        "of one before it asks to join; the others train on meanwhile.",
        "",
        *table(["what", *(name for _, name in parts)], rows),
        "",
        f"Targets with --warm-join: scale-up <= {warm['target_s']:g} s and pause <= "
        f"{warm['pause_target_s']:g} s: {met_text(warm['met'])}.",
        "",
    ]


def _hang_target(hang: dict[str, Any]) -> str:
    """Item 3's target line (results before the agent's stopped limit: max <= lease TTL + 1 s)."""
    if hang.get("target_stat") != "median":
        return f"Target: max <= lease TTL + 1 s = {hang['target_s']:g} s: {met_text(hang['met'])}."
    limit = hang.get("stopped_limit_s")
    why = (
        f" (the agent kills a process stopped for {limit:g} s, then the ring re-forms as after "
        "a SIGKILL)"
        if limit is not None
        else ""
    )
    return (
        f"Target: stopped -> survivors step again, median <= {hang['target_s']:g} s"
        f"{why}: {met_text(hang['met'])}."
    )


def _scaleup_checks(title: str, cold: dict[str, Any], warm: dict[str, Any] | None) -> list[Check]:
    """Item 4's rows of the targets: the cold joiner, and with --warm-join (when measured) the
    rows that the target is for, the cold one being their baseline."""
    figure = f"{stat(cold['elastic_run'])}; pause {stat(cold['pause'])}"
    if not warm:
        return [("scaleup", title, cold["met"], figure)]
    checks = [("scaleup", title, cold["met"], figure + " (cold joiner)")]
    for name, label in WARM_JOBS:
        if name in warm:
            part = warm[name]
            figure = (
                f"{stat(part['elastic_run'])}; pause {stat(part['pause'])} (--warm-join, {label})"
            )
            checks.append((f"scaleup_warm_{name}", title, part["met"], figure))
    return checks


def checks(faults: dict[str, Any]) -> list[Check]:
    """Items 2-4's rows of the targets table (those that ran)."""
    found: list[Check] = []
    for key, title in (
        ("crash", "2. crash recovery"),
        ("hang", "3. hang recovery"),
        ("scaleup", "4. scale-up"),
    ):
        if key in faults:
            part = faults[key]
            figure = stat(part["elastic_run"])
            if key == "scaleup":
                found += _scaleup_checks(title, part, faults.get("scaleup_warm"))
                continue
            if key == "hang" and part.get("target_stat") == "median":
                figure += (
                    f" (target: median <= {part['target_s']:g} s); SIGKILL: median "
                    f"{fixed(part.get('crash_median_s'))} s"
                )
            found.append((key, title, part["met"], figure))
    return found
