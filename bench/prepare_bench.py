"""`elastrain prepare`'s tokenizing: Ray Data over the machine's CPUs vs one process.

The same JSON lines files (`--files` of `--mb` MB each, sentences drawn from the bundled
tiny Shakespeare's words), the same byte-level BPE tokenizer (trained here on a sample,
vocabulary `--vocab`), the same code per file (`elastrain.workers.prepare.tokenize_file`)
and the same shards and index written, three ways, median wall time of `--repeats`:

- one process, the tokenizer on one thread (`TOKENIZERS_PARALLELISM=false`): a plain loop;
- one process, the tokenizer's own threads (`encode_batch` on every core, Rust side);
- Ray Data: a task per file, one CPU each, on a local Ray with every CPU of the machine
  (`Preparation.run`, as a prepare job's process runs it, without the service around it);

and, with `--nodes`, Ray Data on a `ray.cluster_utils.Cluster` of 1..N nodes of one CPU
each (on one machine: the nodes share its cores, so N above the core count shows the
overhead, not a gain).

    .venv/bin/python bench/prepare_bench.py [--quick] [--out docs/bench-prepare.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_blocks import write_block

REPO = Path(__file__).resolve().parents[1]
TENANT = "bench"

#: Runs in a fresh process (the tokenizer's thread pool is set when it is first used).
ONE_PROCESS = """
import sys, time
from pathlib import Path
from elastrain.contracts.workload_params import PrepareParams
from elastrain.workers.prepare import Preparation
root, params = Path(sys.argv[1]), PrepareParams.model_validate_json(sys.argv[2])
t = time.perf_counter()
index = Preparation(params).run(root, lambda _: None, use_ray=False)
print(time.perf_counter() - t, index.tokens)
"""


def make_corpus(root: Path, files: int, mb: float, vocab: int) -> None:
    from importlib import resources

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = resources.files("elastrain.workers.workloads").joinpath("data", "tinyshakespeare.txt")
    words = text.read_text("utf-8").split()
    rng = random.Random(0)
    area = root / "data" / TENANT
    (area / "in").mkdir(parents=True, exist_ok=True)
    sample: list[str] = []
    for f in range(files):
        size, lines = 0, []
        while size < mb * 2**20:
            doc = " ".join(rng.choice(words) for _ in range(rng.randint(40, 400)))
            line = json.dumps({"text": doc}) + "\n"
            lines.append(line)
            size += len(line)
            if f == 0 and len(sample) < 2000:
                sample.append(doc)
        (area / "in" / f"part-{f:03d}.jsonl").write_text("".join(lines))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        sample, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "<|endoftext|>"])
    )
    (area / "tok").mkdir(exist_ok=True)
    tok.save(str(area / "tok" / "tokenizer.json"))


def params_json(out: str) -> str:
    from elastrain.contracts.workload_params import PrepareParams

    return PrepareParams(
        inputs=[f"data/{TENANT}/in/*.jsonl"], tokenizer=f"data/{TENANT}/tok",
        out=f"data/{TENANT}/{out}", eval_fraction=0.01,
    ).model_dump_json()  # fmt: skip


def one_process(root: Path, threads: bool) -> tuple[float, int]:
    shutil.rmtree(root / "data" / TENANT / "one", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"
    done = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, str(root), params_json("one")],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    seconds, tokens = done.stdout.split()
    return float(seconds), int(tokens)


def ray_data(root: Path) -> tuple[float, int]:
    from elastrain.contracts.workload_params import PrepareParams
    from elastrain.workers.prepare import Preparation

    shutil.rmtree(root / "data" / TENANT / "ray", ignore_errors=True)
    params = PrepareParams.model_validate_json(params_json("ray"))
    t = time.perf_counter()
    index = Preparation(params).run(root, lambda _: None)
    assert index is not None
    return time.perf_counter() - t, index.tokens


def median_run(run: Any, repeats: int) -> tuple[float, int]:
    results = [run() for _ in range(repeats)]
    return statistics.median(r[0] for r in results), results[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mb", type=float, default=4.0, help="MB of JSON lines per file")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="largest Cluster (0: none)")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench-prepare.md")
    args = parser.parse_args()
    if args.quick:
        args.files, args.mb, args.vocab, args.repeats, args.nodes = 2, 0.3, 1000, 1, 1
    import ray

    os.environ.setdefault("RAY_TMPDIR", tempfile.gettempdir())
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_corpus(root, args.files, args.mb, args.vocab)
        mb = sum(p.stat().st_size for p in (root / "data" / TENANT / "in").iterdir()) / 2**20
        cpus = len(os.sched_getaffinity(0))
        ways = {
            "one process, tokenizer on 1 thread": lambda: one_process(root, threads=False),
            "one process, tokenizer's own threads": lambda: one_process(root, threads=True),
            f"Ray Data, {cpus} CPUs": lambda: ray_data(root),
        }
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        try:
            ray_data(root)  # warm: the task workers start, Ray Data imports
            # Interleaved, one of each per round: a change in the machine's load (other
            # work on shared cores) weighs on every way alike.
            results: dict[str, list[tuple[float, int]]] = {way: [] for way in ways}
            for _ in range(args.repeats):
                for way, run in ways.items():
                    results[way].append(run())
        finally:
            ray.shutdown()
        for way, got in results.items():
            rows.append({"way": way, "seconds": statistics.median(r[0] for r in got),
                         "tokens": got[0][1]})  # fmt: skip
        rows += cluster_rows(root, args.nodes, args.repeats)
    base = rows[0]["tokens"] / rows[0]["seconds"]
    lines = [
        "| way | seconds | tokens | tokens/s | vs one process, 1 thread |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = r["tokens"] / r["seconds"]
        lines.append(
            f"| {r['way']} | {r['seconds']:.2f} | {r['tokens']:,} | {rate:,.0f} | "
            f"{rate / base:.2f}x |"
        )
    block = "\n".join(
        [
            f"`python bench/prepare_bench.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
            f"— {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.files} JSON lines "
            f"files, {mb:.1f} MB, BPE vocabulary {args.vocab}, median of {args.repeats} "
            f"(interleaved); machine: {os.cpu_count()} CPUs, load average "
            f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after.",
            "",
            *lines,
        ]
    )
    print(block)
    write_block(args.out, "prepare", block, new_document="# Prepare: tokens/s\n")


def cluster_rows(root: Path, nodes: int, repeats: int) -> list[dict[str, Any]]:
    """Ray Data on a multi-node `Cluster` (1 CPU per node), 1..nodes nodes."""
    import ray
    from ray.cluster_utils import Cluster

    rows = []
    for n in range(1, nodes + 1):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(n - 1):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            cluster.wait_for_nodes()
            ray_data(root)  # warm
            seconds, tokens = median_run(lambda: ray_data(root), repeats)
        finally:
            ray.shutdown()
            cluster.shutdown()
        rows.append({"way": f"Ray Data, Cluster of {n} node(s) x 1 CPU", "seconds": seconds,
                     "tokens": tokens})  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
