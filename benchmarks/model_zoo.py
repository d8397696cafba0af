"""Model-zoo sweep: architectures of the installed transformers, built tiny, trained one step
by autopar at pp=1 and at pp=2 zbv (local mode) against eager PyTorch.

For each architecture: a causal LM from its config class with tiny sizes (2 layers, width 32,
4 heads, 4 experts where it has experts, vocabulary 128, fp32, dropout off), a batch of 8
sequences of 16 token ids, next-token cross-entropy on the logits; SGD (lr 0.1, momentum 0.9).
The eager reference runs the same microbatches with gradient accumulation (design.md §5). A
row says ``exact`` when the loss and every parameter after the step agree within 1e-5
(relative, loss) and 1e-5 (absolute, parameters), else the largest difference, or the first
line of the error autopar raised (a ``CaptureError`` names the model's source line).

    python benchmarks/model_zoo.py                       # the default list (docs/model-zoo.md)
    python benchmarks/model_zoo.py qwen3 olmo3 --json    # some architectures, JSON rows

Exit status 0 when every row ran (exact or refused with a CaptureError / ValueError); 1 when
one disagrees with eager or fails with another error.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time

import torch
import torch.nn.functional as F

# newest families of transformers 5 first; none of them is in tests/
DEFAULT = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo3", "olmo_hybrid", "minimax_m2", "seed_oss",
           "smollm3", "nanochat", "ministral3", "vaultgemma", "exaone4", "glm4", "hunyuan_v1_dense", "phi3",
           "cohere2", "granitemoe", "olmoe", "apertus", "ernie4_5")
VOCAB, BATCH, SEQ = 128, 8, 16
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
             linear_key_head_dim=8, linear_value_head_dim=8, attention_dropout=0.0, hidden_dropout=0.0,
             pad_token_id=0, bos_token_id=0, eos_token_id=0)
PLANS = (("pp=1", dict(pp=1, num_microbatches=2)), ("pp=2 zbv", dict(pp=2, schedule="zbv", num_microbatches=4)))
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def build(name: str, seed: int = 0):
    """The tiny model of ``name`` (a transformers model type), in train mode, and its batch."""
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[name](**SIZES)
    cfg.use_cache = False
    for key, value in cfg.to_dict().items():  # every dropout off, whatever the family calls it
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    torch.manual_seed(seed)
    try:
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    except ValueError:  # families without an SDPA path run their eager attention
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.train()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    target = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    return model, ids, target


def lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def eager_step(model, ids, target, m: int):
    """One SGD step over ``m`` microbatches with gradient accumulation: (loss, state)."""
    opt = SGD([p for p in model.parameters() if p.requires_grad])
    total = 0.0
    for x, y in zip(ids.chunk(m), target.chunk(m)):
        loss = lm_loss(model(x), y) / m
        loss.backward()
        total += loss.detach()
    opt.step()
    return total, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(name: str) -> list[dict]:
    import autopar

    rows = []
    try:
        model, ids, target = build(name)
    except Exception as e:  # noqa: BLE001 - a config the tiny sizes do not fit is a row too
        return [{"arch": name, "plan": p, "result": "not built", "detail": _first_line(e)} for p, _ in PLANS]
    for label, plan in PLANS:
        t0 = time.perf_counter()
        row = {"arch": name, "plan": label}
        try:
            ref_loss, ref_state = eager_step(copy.deepcopy(model), ids, target, plan["num_microbatches"])
            pm = autopar.parallelize(copy.deepcopy(model), (ids,), loss_fn=lm_loss, optimizer=SGD,
                                     plan=autopar.Plan(**plan), example_target=target)
            loss = pm.step((ids,), target)
            state = pm.state_dict()
            loss_diff = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-12)
            param_diff = max((state[k].float() - v.float()).abs().max().item() for k, v in ref_state.items()
                             if v.is_floating_point())
            exact = loss_diff <= 1e-5 and param_diff <= 1e-5
            row.update(result="exact" if exact else "differs",
                       detail=f"loss {loss_diff:.1e} rel, params {param_diff:.1e} abs")
        except (autopar.CaptureError, ValueError) as e:
            row.update(result="refused", detail=_first_line(e), error=type(e).__name__)
        except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
            row.update(result="failed", detail=_first_line(e), error=type(e).__name__)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"{name:20s} {label:9s} {row['result']:9s} {row['seconds']:6.1f}s  {row['detail'][:150]}",
              file=sys.stderr, flush=True)
    return rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:400]


def markdown(rows: list[dict]) -> str:
    out = ["| architecture | plan | result | detail |", "|---|---|---|---|"]
    for r in rows:
        detail = r["detail"].replace("|", "\\|")
        out.append(f"| {r['arch']} | {r['plan']} | {r['result']} | {detail} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archs", nargs="*", default=list(DEFAULT), help="transformers model types (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a markdown table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for name in args.archs for r in run(name)]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0 if all(r["result"] in ("exact", "refused", "not built") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
