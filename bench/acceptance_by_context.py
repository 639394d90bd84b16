"""Mean accepted tokens per round of the embedded pair at q draft tokens, by context length.

Prompts are cut from the held-out standard library modules; greedy decoding, resident mode,
the draft's default window cache. Prints a table and, with ``--update-card``, writes the figures
into the package's model card (specstream/assets/model_card.json and MODEL_CARD.md).

    python bench/acceptance_by_context.py [--contexts 1024,4096,8000] [-q 4] [--update-card]
"""

from __future__ import annotations

import argparse
import json
import re

from specstream import LLM, SamplingParams
from specstream.bench.workload import Workload, build_prompts
from specstream.llm import default_model_dir

SECTION = "## Mean accepted tokens per round"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,8000")
    ap.add_argument("-q", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--update-card", action="store_true")
    args = ap.parse_args()
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        llm = LLM(draft_model=default_model_dir("draft"), num_speculative_tokens=args.q,
                  device_kv_bytes=1 << 30, max_prefill_tokens=2048)
        prompts = build_prompts(Workload((ctx,) * args.requests, args.output_len),
                                llm.tokenizer, llm.engine.model_config.vocab_size, seed=7)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        m = llm.get_metrics()
        rows.append({"context": ctx, "q": args.q, "mean_accepted_len": m["mean_accepted_len"],
                     "acceptance_rate": m["acceptance_rate"], "rounds": m["rounds"]})
        print(f"context {ctx:>5}: mean accepted tokens/round {m['mean_accepted_len']:.2f} "
              f"(acceptance rate {m['acceptance_rate']:.2f}, {m['rounds']} rounds)", flush=True)
        llm.close()
    if args.update_card:
        assets = default_model_dir("target").parent
        card_json = assets / "model_card.json"
        card = json.loads(card_json.read_text()) if card_json.is_file() else {}
        card["mean_accepted_tokens_per_round"] = rows
        card_json.write_text(json.dumps(card, indent=1))
        md_path = assets / "MODEL_CARD.md"
        md = md_path.read_text() if md_path.is_file() else ""
        table = "\n".join(
            [f"{SECTION} (q={args.q})", "",
             "Measured by `python bench/acceptance_by_context.py --update-card` (greedy, "
             f"{args.requests} requests x {args.output_len} new tokens per context, prompts "
             "from the held-out modules, the draft's default window cache):", "",
             "| context tokens | mean accepted tokens per round | acceptance rate |",
             "| --- | --- | --- |"]
            + [f"| {r['context']} | {r['mean_accepted_len']:.2f} | {r['acceptance_rate']:.2f} |"
               for r in rows]) + "\n"
        pattern = re.compile(rf"{re.escape(SECTION)}.*?(?=\n## |\Z)", re.S)
        md = pattern.sub(table, md) if pattern.search(md) else md.rstrip() + "\n\n" + table
        md_path.write_text(md)
        print("updated the model card (specstream/assets/MODEL_CARD.md)")


if __name__ == "__main__":
    main()
