"""Sentence embeddings per second: the padding-free encoder vs ``SentenceTransformer.encode``.

Embeds a generated corpus (2,000 sentences by default, from a few tokens to the model's
256-token limit) with all-MiniLM-L6-v2 twice: through ``headwise.integrations.sentence_transformers`` (tokens packed,
no compute on padding; see ``examples/packed_bert.py``) and through sentence-transformers
(padded batches, which it sorts by length first to limit padding), with the same batch
size. Runs alternate between the two so that a busy machine slows both alike; the table
gives the median sentences per second of each, the ratio, the tokens each one computes,
and how far apart the embeddings are.

    python benchmarks/embed_throughput.py [--sentences 2000] [--batch-size 32] [--rounds 1]
    python benchmarks/embed_throughput.py --quick         # 300 sentences, a smoke run
    python benchmarks/embed_throughput.py --threads 1     # steadier on a machine others share
    python benchmarks/embed_throughput.py --unsorted      # also: padded batches in corpus order

``--unsorted`` adds what padding costs when batches cannot be sorted by length first (a
server embedding requests as they come): the same Hugging Face model on padded batches
taken in corpus order.

Legend: N sentences, E embed dim.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from headwise.integrations.sentence_transformers import default_model_dir, load_encoder

WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but have
an they you were her she there one all we their has been would when who will more no if out so said
what up its about into than them can only other new some could time these two may then do first any
my now such like our over man me even most made after also did many before must through back years
where much your way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never day same another
know while last might us great old year off come since against go came right used take three small
attention head query key value mask padding token sequence batch softmax kernel memory model layer
encoder embedding vector matrix weight gradient tensor shape width length position window cache
""".split()  # noqa: SIM905  (a paragraph reads better than 180 quoted words)


def make_corpus(n: int, seed: int = 0, max_words: int = 300) -> list[str]:
    """``n`` sentences whose word counts are log-uniform in [2, max_words]: many short, some
    past the model's limit (they are truncated, as sentence-transformers does)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        words = int(math.exp(rng.uniform(math.log(2), math.log(max_words))))
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        sentences.append(text[0].upper() + text[1:] + rng.choice(".?!"))
    return sentences


def padded_tokens(lengths: list[int], sentences: list[str], batch_size: int) -> int:
    """Tokens sentence-transformers computes: it sorts by characters, then pads each batch."""
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    return sum(max(lengths[i] for i in order[s:s + batch_size]) * len(order[s:s + batch_size])
               for s in range(0, len(order), batch_size))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="timed runs of each, alternating (default 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--unsorted", action="store_true",
                        help="also time padded batches in corpus order (no length sorting)")
    parser.add_argument("--quick", action="store_true", help="300 sentences, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.sentences, args.rounds = 300, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    console = Console(width=120)
    corpus = make_corpus(args.sentences)
    ours = load_encoder()
    theirs = SentenceTransformer(str(default_model_dir()), device="cpu")
    lengths = [len(ids) for ids in ours.tokenize(corpus)]
    real, padded = sum(lengths), padded_tokens(lengths, corpus, args.batch_size)
    console.print(f"{len(corpus)} sentences, tokens per sentence min {min(lengths)}, median "
                  f"{statistics.median(lengths):.0f}, max {max(lengths)} ({sum(n == ours.max_length for n in lengths)} "
                  f"at the {ours.max_length}-token limit); batch size {args.batch_size}; "
                  f"{torch.get_num_threads()} threads")

    def run_ours():
        return ours.encode(corpus, batch_size=args.batch_size)

    def run_theirs():
        return theirs.encode(corpus, batch_size=args.batch_size, convert_to_tensor=True)

    @torch.inference_mode()
    def run_unsorted():
        """sentence-transformers' own modules on padded batches, in corpus order."""
        out = []
        for start in range(0, len(corpus), args.batch_size):
            features = theirs.preprocess(corpus[start:start + args.batch_size])
            out.append(theirs(features)["sentence_embedding"])
        return torch.cat(out)

    warm = corpus[:2 * args.batch_size]
    ours.encode(warm, batch_size=args.batch_size)
    theirs.encode(warm, batch_size=args.batch_size)
    times: dict[str, list[float]] = {"headwise": [], "sentence-transformers": []}
    if args.unsorted:
        times["unsorted"] = []
    outputs = {}
    for r in range(args.rounds):
        runs = [("headwise", run_ours), ("sentence-transformers", run_theirs)]
        if args.unsorted:
            runs.append(("unsorted", run_unsorted))
        for name, fn in runs if r % 2 == 0 else runs[::-1]:
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    a, b = outputs["headwise"], outputs["sentence-transformers"].float()
    cosine = (a * b).sum(-1)  # (N,)
    speed = {name: len(corpus) / statistics.median(ts) for name, ts in times.items()}

    table = Table(title=f"all-MiniLM-L6-v2 embeddings, {len(corpus)} sentences, batch size {args.batch_size} "
                  f"(median of {args.rounds} run{'s' if args.rounds > 1 else ''})")
    for column in ("encoder", "sentences / s", "seconds", "tokens computed", "vs sentence-transformers"):
        table.add_column(column, justify="right")
    table.add_row("headwise packed (no padding)", f"{speed['headwise']:.1f}",
                  f"{statistics.median(times['headwise']):.1f}", f"{real:,}",
                  f"[bold]{speed['headwise'] / speed['sentence-transformers']:.2f}x[/]")
    table.add_row("SentenceTransformer.encode", f"{speed['sentence-transformers']:.1f}",
                  f"{statistics.median(times['sentence-transformers']):.1f}",
                  f"{padded:,} ({1 - real / padded:.0%} padding)", "1.00x")
    if args.unsorted:
        unsorted = sum(max(lengths[start:start + args.batch_size]) * len(lengths[start:start + args.batch_size])
                       for start in range(0, len(lengths), args.batch_size))
        table.add_row("same model, padded batches in corpus order", f"{speed['unsorted']:.1f}",
                      f"{statistics.median(times['unsorted']):.1f}",
                      f"{unsorted:,} ({1 - real / unsorted:.0%} padding)",
                      f"{speed['unsorted'] / speed['sentence-transformers']:.2f}x")
    console.print(table)
    console.print(f"embeddings: cosine min {cosine.min().item():.7f}, max |difference| "
                  f"{(a - b).abs().max().item():.1e}; runs (s): "
                  + ", ".join(f"{k} {[round(t, 1) for t in v]}" for k, v in times.items()))


if __name__ == "__main__":
    main()
