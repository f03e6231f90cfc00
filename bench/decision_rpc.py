"""The price of deciding in another process: the router's decision made in place, against the same decision asked
of a decider process over a Unix socket, as the planned multi-process gateway would (docs/architecture.md, "Using
more than one core": workers relay, one process decides).

    .venv/bin/python bench/decision_rpc.py [--requests 20000] [--concurrency 1 16 64] [--replicas 4]

In place: ``Router.try_acquire`` with the request's prompt (a rendered chat of about 2 KB: filters, scorers, the
prefix index) then ``release``, as the gateway's admission does per attempt. Over the socket: a worker sends the
same prompt (msgpack, length-prefixed frames), the decider runs the same router and answers the replica's name and a
lease number; the worker then sends the release (one frame, no answer awaited), so each attempt costs one round
trip. ``--concurrency`` decisions are in flight at once from one worker process (its tasks share one connection,
answers matched by number), as a worker relaying many streams would ask.

Prints per row: decisions/s, the round trip's p50/p99 as the worker sees it, and the CPU per decision of the decider
and of the worker (psutil: user + system of each process), against the in-place decision's CPU. Numbers, never
assertions; run it on a quiet machine, and compare rows of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.gateway.routing.request import RoutingRequest, render_chat  # noqa: E402
from appliance.gateway.routing.router import Outcome, Router  # noqa: E402
from appliance.gateway.routing.settings import RoutingSettings  # noqa: E402
from appliance.gateway.schemas import ChatMessage  # noqa: E402
from tests.doubles import FakeReplica  # noqa: E402

FRAME = struct.Struct("!I")
WORDS = ("the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "as", "with", "by", "at", "from", "model",
         "value", "return", "function", "class")


def prompts(count: int, seed: int = 1) -> list[str]:
    """Rendered chats of about 2 KB: a system prompt of their own, two earlier turns, a question."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        system = f"conversation {i} " + " ".join(rng.choice(WORDS) for _ in range(120))
        messages = [ChatMessage(role="system", content=system)]
        for turn in range(2):
            messages += [ChatMessage(role="user", content=f"question {turn} " * 20),
                         ChatMessage(role="assistant", content=f"answer {turn} " * 30)]
        messages.append(ChatMessage(role="user", content="and now?"))
        out.append(render_chat(messages))
    return out


def router(replicas: int) -> Router:
    fleet = [FakeReplica(f"replica-{i}") for i in range(replicas)]
    return Router(lambda: fleet, RoutingSettings())


def cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


# -- in place --------------------------------------------------------------------------------------------------

def in_place(texts: list[str], replicas: int) -> float:
    """CPU seconds per decision and release, made where the request is."""
    decide = router(replicas)
    for text in texts[:1000]:  # warm the index as the socket's decider will be
        decide.release(decide.try_acquire(request=RoutingRequest(text)), Outcome.SUCCESS)
    me = psutil.Process()
    before = cpu(me)
    for text in texts:
        decide.release(decide.try_acquire(request=RoutingRequest(text)), Outcome.SUCCESS)
    return (cpu(me) - before) / len(texts)


# -- the decider -----------------------------------------------------------------------------------------------

async def read_frame(reader: asyncio.StreamReader) -> bytes:
    size = FRAME.unpack(await reader.readexactly(FRAME.size))[0]
    return await reader.readexactly(size)


def frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload)) + payload


def decider(path: str, replicas: int, ready: multiprocessing.synchronize.Event) -> None:
    """Answers ``[number, prompt]`` with ``[number, replica, lease]``; ``[-lease]`` releases a lease."""
    decide = router(replicas)
    leases: dict[int, object] = {}
    numbers = itertools.count(1)
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                message = decode(await read_frame(reader))
                if len(message) == 1:
                    decide.release(leases.pop(-message[0]), Outcome.SUCCESS)
                    continue
                replica = decide.try_acquire(request=RoutingRequest(message[1]))
                lease = next(numbers)
                leases[lease] = replica
                writer.write(frame(encode([message[0], replica.name, lease])))
        except asyncio.IncompleteReadError:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(serve, path)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- a worker --------------------------------------------------------------------------------------------------

async def ask(path: str, texts: list[str], concurrency: int) -> tuple[float, list[float]]:
    """Every text decided and released through the socket, ``concurrency`` at once; returns the wall time and
    each round trip."""
    reader, writer = await asyncio.open_unix_connection(path)
    encode, decode = msgspec.msgpack.encode, msgspec.msgpack.decode
    waiting: dict[int, asyncio.Future[list]] = {}
    numbers = itertools.count(1)

    async def answers() -> None:
        while True:
            answer = decode(await read_frame(reader))
            waiting.pop(answer[0]).set_result(answer)

    listener = asyncio.get_running_loop().create_task(answers())
    queue = iter(texts)
    trips: list[float] = []

    async def client() -> None:
        for text in queue:
            number = next(numbers)
            future: asyncio.Future[list] = asyncio.get_running_loop().create_future()
            waiting[number] = future
            sent = time.perf_counter()
            writer.write(frame(encode([number, text])))
            answer = await future
            trips.append(time.perf_counter() - sent)
            writer.write(frame(encode([-answer[2]])))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    listener.cancel()
    writer.close()
    return wall, trips


def over_socket(texts: list[str], replicas: int, concurrency: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "decider.sock")
        ready = multiprocessing.Event()
        process = multiprocessing.Process(target=decider, args=(path, replicas, ready), daemon=True)
        process.start()
        try:
            ready.wait(30)
            asyncio.run(ask(path, texts[:1000], concurrency))  # warm, as in place
            theirs, mine = psutil.Process(process.pid), psutil.Process()
            their_cpu, my_cpu = cpu(theirs), cpu(mine)
            wall, trips = asyncio.run(ask(path, texts, concurrency))
            return {"decisions_s": len(texts) / wall,
                    "rtt_p50_us": 1e6 * statistics.median(trips),
                    "rtt_p99_us": 1e6 * statistics.quantiles(trips, n=100)[98],
                    "decider_cpu_us": 1e6 * (cpu(theirs) - their_cpu) / len(texts),
                    "worker_cpu_us": 1e6 * (cpu(mine) - my_cpu) / len(texts)}
        finally:
            process.kill()
            process.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    texts = prompts(2000)
    load = [texts[i % len(texts)] for i in range(args.requests)]
    place = in_place(load, args.replicas)
    print(f"{args.requests} decisions of ~{len(texts[0])}-character chats over {args.replicas} replicas "
          f"(prefix index warm), on {len(os.sched_getaffinity(0))} cores")
    print(f"in place: {1e6 * place:.1f} us CPU per decision and release")
    print(f"{'in flight':>9} {'decisions/s':>11} {'RTT p50 us':>10} {'RTT p99 us':>10} {'decider CPU us':>14} "
          f"{'worker CPU us':>13} {'decider / in place':>18}")
    for concurrency in args.concurrency:
        row = over_socket(load, args.replicas, concurrency)
        print(f"{concurrency:>9} {row['decisions_s']:>11.0f} {row['rtt_p50_us']:>10.1f} {row['rtt_p99_us']:>10.1f} "
              f"{row['decider_cpu_us']:>14.1f} {row['worker_cpu_us']:>13.1f} "
              f"{row['decider_cpu_us'] / (1e6 * place):>18.2f}")


if __name__ == "__main__":
    main()
