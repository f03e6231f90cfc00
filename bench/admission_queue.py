"""What the gateway's admission queue costs per release as the queue grows: every release hands the freed slot to
the next waiter in fair order, so that work must not grow with the number of waiters (thousands of queued streams
are the load the gateway is meant to hold).

One process, no network: ``Admission`` over ``--replicas`` fake replicas of limit ``--limit``, filled, then
``--depth`` requests queued from ``--tenants`` tenants; each measured step releases one lease (its waiter takes the
slot) and queues a new request, so the depth holds. Prints CPU microseconds per release at each depth and the ratio of
the deepest to the shallowest (1.0: flat). Run it on two trees to compare (``PYTHONPATH=<tree>``), never as an
assertion.

    .venv/bin/python bench/admission_queue.py [--depths 0,64,1024,4096] [--steps 2000] [--tenants 1,4]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.gateway.admission.limit import AIMDLimit, ConcurrencyLimits  # noqa: E402
from appliance.gateway.admission.queue import Admission  # noqa: E402
from appliance.gateway.admission.slots import Lease  # noqa: E402
from appliance.gateway.routing.router import Outcome, Router  # noqa: E402
from appliance.gateway.tenants.directory import Tenant  # noqa: E402
from tests.doubles import FakeReplica  # noqa: E402


def build(limit: int, replicas: int, max_queue: int) -> Admission:
    fleet = [FakeReplica(f"replica-{i}", f"http://r{i}") for i in range(replicas)]
    limits = ConcurrencyLimits(lambda: AIMDLimit(limit, 1, limit, target_seconds=1.0))
    return Admission(Router(lambda: fleet, limit_for=limits.limit_of), limits, max_queue=max_queue,
                     queue_timeout_seconds=3600)


async def per_release(depth: int, tenants: int, steps: int, limit: int, replicas: int) -> float:
    """CPU seconds per measured step (one release served to a waiter, one new request queued)."""
    admission = build(limit, replicas, max_queue=depth + limit * replicas + 1)
    names = [Tenant(f"t{i}") for i in range(tenants)]
    held: list[Lease] = [await admission.acquire(tenant=names[i % tenants]) for i in range(limit * replicas)]
    waiting = deque(asyncio.create_task(admission.acquire(tenant=names[i % tenants])) for i in range(depth))
    await asyncio.sleep(0)
    started = time.process_time()
    for step in range(steps):
        held.pop(0).release(Outcome.SUCCESS, 0.01)
        waiting.append(asyncio.create_task(admission.acquire(tenant=names[step % tenants])))
        await asyncio.sleep(0)
        while waiting and waiting[0].done():  # the oldest waiter is served first (one tenant, or in turn)
            held.append(waiting.popleft().result())
    spent = time.process_time() - started
    for task in waiting:
        task.cancel()
    for result in await asyncio.gather(*waiting, return_exceptions=True):
        if isinstance(result, Lease):
            held.append(result)
    for lease in held:
        lease.release(Outcome.ABORTED)
    return spent / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="0,64,1024,4096")
    parser.add_argument("--tenants", default="1,4")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    print(f"admission from {Path(sys.modules['appliance'].__file__ or '').parent}; {args.replicas} replicas x limit "
          f"{args.limit}; {args.steps} releases per depth")
    print(f"{'tenants':>8} " + " ".join(f"{'depth ' + str(d):>11}" for d in depths) + "   deepest/shallowest")
    for tenants in (int(t) for t in args.tenants.split(",")):
        costs = [asyncio.run(per_release(d, tenants, args.steps, args.limit, args.replicas)) for d in depths]
        cells = " ".join(f"{c * 1e6:8.1f} us" for c in costs)
        print(f"{tenants:>8} {cells}   {costs[-1] / costs[0]:.2f}")


if __name__ == "__main__":
    main()
