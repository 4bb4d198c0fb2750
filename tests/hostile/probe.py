"""The hostile-tenant probe of issue 30: three tenants against a real `loraserve serve` on loopback (Redis
config store, moto S3 adapter store, a tiny random Llama on the CPU), re-trying every failure the issue
lists and the probes that passed before it, then printing

    | category | tried | wrongly accepted | 5xx | stalls | leaks | other |

    python tests/hostile/probe.py            # the full probe: >= 1,300 requests and uploads, >= 900 streams
    python tests/hostile/probe.py --quick    # a few of each (what the smoke test runs)

Run from the repo root with PYTHONPATH=$PWD:$PWD/platform (or an installed checkout); it needs
redis-server on the PATH and moto installed (the dev extra). Nothing leaves 127.0.0.1. Bounded: every call
has a timeout, and phases past --budget-s are skipped and listed as not run. Exit status 0 only if every
column but `tried` is 0 and every phase ran. Columns: `wrongly accepted` is bad input answered 2xx (or a
request the server should have refused let through); `stalls` is /health on either port slower than
2 s, another tenant's small request slower than 8 s, or a wait that did not end; `leaks` is another
tenant's data, a server path in an answer, a lease, file or process left behind, or memory growth;
`other` is a valid request refused, an error without OpenAI's body, a stream that ended without [DONE].
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for folder in (
    REPO / "tests" / "e2e",
    REPO / "tests" / "platform",
    REPO / "tests",
    REPO / "platform",
    REPO,
    HERE,
):
    sys.path.insert(0, str(folder))

import probes_input  # noqa: E402
import probes_load  # noqa: E402
import probes_store  # noqa: E402
import stack as stack_module  # noqa: E402
from client import Api  # noqa: E402
from tally import HealthWatch, Tally  # noqa: E402

FULL = {"cache_rounds": 60, "disconnect_rounds": 20, "race_rounds": 15, "delete_rounds": 10, "streams": 900}
QUICK = {"cache_rounds": 2, "disconnect_rounds": 2, "race_rounds": 2, "delete_rounds": 1, "streams": 30}


async def run(
    stack: stack_module.Stack, tally: Tally, sizes: dict, budget_s: float, skipped: list[str]
) -> None:
    server = stack.start_server()
    api, metrics = Api(server.url), Api(server.metrics_url)
    deadline = time.monotonic() + budget_s
    phases = [
        ("bad input", lambda: probes_input.bad_input(api, tally)),
        ("hostile adapters", lambda: probes_input.hostile_adapters(api, tally, stack)),
        ("cross-tenant", lambda: probes_input.cross_tenant(api, tally)),
        ("minor", lambda: probes_input.minor(api, tally, stack)),
        ("prefix cache", lambda: probes_load.prefix_cache(api, tally, sizes["cache_rounds"])),
        ("grammar", lambda: probes_load.grammar(api, tally)),
        ("large bodies", lambda: probes_load.large_bodies(api, tally)),
        (
            "early disconnects",
            lambda: probes_load.early_disconnects(api, tally, metrics, sizes["disconnect_rounds"]),
        ),
        ("success counter", lambda: probes_load.success_counter(api, tally, metrics)),
        ("token rate", lambda: probes_load.token_rate(api, tally)),  # last of carol's: it fills her minute
        ("disk cache", lambda: probes_store.disk_cache(api, tally, stack, len(stack.adapter_dirs) * 2)),
        ("uploads", lambda: probes_store.uploads(api, tally, stack)),
        ("route race", lambda: probes_store.route_race(api, tally, sizes["race_rounds"])),
        (
            "delete while streaming",
            lambda: probes_store.delete_while_streaming(api, tally, sizes["delete_rounds"]),
        ),
        ("streams", lambda: probes_store.streams_under_churn(api, tally, stack, sizes["streams"])),
    ]
    try:
        with HealthWatch(tally, [server.url, server.metrics_url]) as watch:
            for name, phase in phases:
                if time.monotonic() > deadline:
                    skipped.append(name)
                    continue
                started = time.monotonic()
                await asyncio.wait_for(phase(), timeout=max(60.0, deadline - time.monotonic() + 120))
                print(f"  {name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
            watch.pause(True)
            await probes_store.sigterm_mid_upload(api, tally, stack)
        # a second server for the core's death (the first one has drained away)
        server = stack.start_server()
        await api.close()
        api = Api(server.url)
        await probes_store.kill_core(api, tally, stack)
    finally:
        await api.close()
        await metrics.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few of each probe (the smoke test)")
    parser.add_argument(
        "--workdir", type=Path, help="where to put the model, logs and stores (default: a temp dir)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=1800.0, help="skip phases that would start after this"
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    root = args.workdir or Path(tempfile.mkdtemp(prefix="hostile-probe-"))
    started = time.monotonic()
    stack = stack_module.build(root, num_adapters=2 if args.quick else 4)
    tally = Tally(stack.secrets)
    skipped: list[str] = []
    try:
        for folder in stack.adapter_dirs:
            probes_input.UPLOAD_FILES[folder.name] = probes_store.files_of(folder)
        probes_input.UPLOAD_FILES["good"] = probes_input.UPLOAD_FILES["adapter-0"]
        asyncio.run(run(stack, tally, sizes, args.budget_s, skipped))
    finally:
        stack.close()
    requests = sum(row.tried for row in tally.rows.values()) - tally.streams
    print(tally.table())
    print(
        f"\n{requests} requests and uploads, {tally.streams} streams, {time.monotonic() - started:.0f} s; "
        f"logs under {root}"
    )
    for name, seconds in sorted(tally.worst_health.items()):
        print(f"slowest /health during {name}: {seconds:.2f} s")
    for line in tally.failures():
        print(f"- {line}")
    if skipped:
        print(f"NOT RUN (past --budget-s): {', '.join(skipped)}")
    return 0 if tally.clean() and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
