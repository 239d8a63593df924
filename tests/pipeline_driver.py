"""Train a tiny HF causal LM with the pipeline engine (under torchrun), or as a 1-process reference.

    torchrun --nproc_per_node 2 tests/pipeline_driver.py --model llama --pp 2 --out run.json
    python tests/pipeline_driver.py --model llama --reference --dp 1 --out ref.json

Both modes build the model from a config with the same seed, see the same random token data (right
padded, labels -100 on padding) in the same micro-batches, and use AdamW + linear schedule + clipping
in fp32, so their per-step losses must agree. The pipeline run can also save / resume a DeepSpeed
checkpoint and export an HF model; rank 0 then reloads the export with `from_pretrained`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

SEED = 1234
VOCAB = 256


def tiny_model(kind: str):
    """A tiny causal LM built from a config (never downloaded), identical for the same seed."""
    import transformers

    common = dict(vocab_size=VOCAB, max_position_embeddings=128)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **common,
        )
    elif kind == "qwen2":  # tied embeddings in a rotary family
        config = transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            **common,
        )
    elif kind == "mistral":  # a sliding window shorter than the sequence
        config = transformers.MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            tie_word_embeddings=False,
            **common,
        )
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=128,
            n_embd=64,
            n_layer=4,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
        )
    else:
        raise SystemExit(f"unknown model {kind}")
    torch.manual_seed(SEED)
    return transformers.AutoModelForCausalLM.from_config(config)


def micro_batch(generator: torch.Generator, micro: int, seq: int) -> dict[str, torch.Tensor]:
    """Random tokens, right padded to `seq` with a random real length per row."""
    input_ids = torch.randint(1, VOCAB, (micro, seq), generator=generator)
    lengths = torch.randint(seq // 2, seq + 1, (micro,), generator=generator)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    input_ids = input_ids * attention_mask  # pad id 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def dataset(args) -> tuple[list[list[list[dict]]], list[list[dict]]]:
    """train[step][data_parallel_rank][micro_step], evaluation[data_parallel_rank][micro_step]."""
    generator = torch.Generator().manual_seed(SEED)
    train = [
        [
            [micro_batch(generator, args.micro, args.seq) for _ in range(args.ga)]
            for _ in range(args.dp)
        ]
        for _ in range(args.steps)
    ]
    evaluation = [
        [micro_batch(generator, args.micro, args.seq) for _ in range(2)] for _ in range(args.dp)
    ]
    return train, evaluation


def ds_config(args) -> dict:
    """The DeepSpeed config the pipeline engine needs (what dplaunch's renderer must write)."""
    config = {
        # pipeline stages do not multiply the batch: micro × grad-accum × data-parallel size
        "train_batch_size": args.micro * args.ga * args.dp,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.ga,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": args.lr,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.1,
                # torch's AdamW: what the reference uses, and no C++ op to build on CPU
                "torch_adam": True,
            },
        },
        "gradient_clipping": args.clip,
        "zero_optimization": {"stage": args.zero_stage},
        "bf16": {"enabled": args.bf16},
        "fp16": {"enabled": False},
        "pipeline": {"activation_checkpoint_interval": args.activation_checkpoint_interval},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.optimizer == "factory":
        # the optimizer comes from optimizer_factory, as dplaunch's loop does it
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
    return config


def adamw(parameters, args) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def scheduler_factory(args):
    import transformers

    def factory(optimizer):
        return transformers.get_scheduler(
            "linear", optimizer, num_warmup_steps=1, num_training_steps=args.steps
        )

    return factory


def hf_eval(model, evaluation) -> tuple[float, float, torch.Tensor]:
    """Mean HF loss over all evaluation micro-batches, token-mean loss, logits of the first one."""
    from dplaunch.train.engines import loss_sums

    model.eval()
    with torch.no_grad():
        outputs = [model(**batch) for shard in evaluation for batch in shard]
        labels = [batch["labels"] for shard in evaluation for batch in shard]
        sums = torch.stack(
            [
                torch.stack(loss_sums(o.logits, y, "causal-lm")).sum(-1)
                for o, y in zip(outputs, labels, strict=True)
            ]
        ).sum(0)
    mean_loss = torch.stack([o.loss for o in outputs]).mean().item()
    return mean_loss, (sums[0] / sums[1]).item(), outputs[0].logits


def run_reference(args) -> dict:
    """Plain HF model, one process: the same global batch as dp replicas × grad-accum."""
    model = tiny_model(args.model)
    model.train()
    train, evaluation = dataset(args)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(parameters, args)
    scheduler = scheduler_factory(args)(optimizer)
    losses, lrs, norms = [], [], []
    for step in range(args.steps):
        micro_batches = [batch for shard in train[step] for batch in shard]
        total = 0.0
        for batch in micro_batches:
            loss = model(**batch).loss / len(micro_batches)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(
            parameters, args.clip if args.clip > 0 else float("inf")
        )
        norms.append(norm.item())
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    eval_loss, token_loss, logits = hf_eval(model, evaluation)
    torch.save(logits, Path(args.out).with_suffix(".logits.pt"))
    return {
        "losses": losses,
        "lrs": lrs,
        "grad_norms": norms,
        "eval_loss": eval_loss,
        "eval_token_loss": token_loss,
    }


def run_pipeline(args) -> dict:
    import torch.distributed as dist

    from dplaunch.train.pipeline import create_pipeline_engine

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    assert world == args.dp * args.pp, f"world {world} != dp {args.dp} × pp {args.pp}"
    model = tiny_model(args.model)
    if args.hf_gradient_checkpointing:
        # HF's own per-block checkpointing, as dplaunch's model.gradient_checkpointing sets it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = create_pipeline_engine(
        model,
        num_stages=args.pp,
        ds_config=ds_config(args),
        lr_scheduler_factory=scheduler_factory(args),
        seed=SEED,
        optimizer_factory=(lambda module: adamw(module.parameters(), args))
        if args.optimizer == "factory"
        else None,
    )
    assert engine.data_parallel_size == args.dp
    train, evaluation = dataset(args)
    shard = engine.data_parallel_rank

    first_step = 0
    if args.resume_from:
        client_state = engine.load_checkpoint(args.resume_from, args.tag)
        first_step = client_state["next_step"]
    losses, lrs, norms = {}, {}, {}
    for step in range(first_step, args.steps):
        if args.save_to and step == args.save_at:
            engine.save_checkpoint(args.save_to, args.tag, {"next_step": step})
        lrs[step] = engine.current_lr()
        loss = engine.train_step(train[step][shard])
        assert loss.dim() == 0 and not loss.requires_grad
        losses[step] = loss.item()
        norm = engine.engine.get_global_grad_norm()  # None where DeepSpeed does not record it
        norms[step] = None if norm is None else float(norm)
    eval_loss = engine.eval_loss(evaluation[shard]).item()
    # the loop's per-row interface: every stage gets the last stage's numbers
    sums = torch.stack(
        [torch.stack(engine.eval_batch(batch)).sum(-1) for batch in evaluation[shard]]
    ).sum(0)
    dist.all_reduce(
        sums
    )  # every stage of a pipeline holds its shard's sums: the ratio is unchanged
    eval_token_loss = (sums[0] / sums[1]).item()
    engine.train()

    # every rank must report the same numbers
    everyone = [None] * world
    dist.all_gather_object(
        everyone, {"losses": losses, "eval_loss": eval_loss, "token": eval_token_loss}
    )
    result = {
        "losses": [losses[s] for s in sorted(losses)],
        "first_step": first_step,
        "lrs": [lrs[s] for s in sorted(lrs)],
        "grad_norms": [norms[s] for s in sorted(norms)],
        "eval_loss": eval_loss,
        "eval_token_loss": eval_token_loss,
        "layout": engine.layout_lines(),
        "ranks_agree": all(r == everyone[0] for r in everyone),
        "stage_parts": [int(p) for p in engine.pipe.parts],
        "checkpointed_chunks": list(engine.pipe.is_checkpointable_results),
    }
    if args.export:
        engine.export_hf(args.export, model)
        if dist.get_rank() == 0:
            import transformers

            exported = transformers.AutoModelForCausalLM.from_pretrained(args.export)
            result["export_eval_loss"], result["export_eval_token_loss"], logits = hf_eval(
                exported, evaluation
            )
            result["export_files"] = sorted(os.listdir(args.export))
            result["export_dtype"] = str(next(exported.parameters()).dtype)
            torch.save(logits, Path(args.out).with_suffix(".logits.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=["llama", "qwen2", "mistral", "gpt2"])
    parser.add_argument("--reference", action="store_true", help="plain HF model, one process")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument(
        "--dp", type=int, default=1, help="data-parallel replicas (reference: simulated)"
    )
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--ga", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument(
        "--optimizer",
        default="config",
        choices=["config", "factory"],
        help="AdamW from ds_config['optimizer'] or from optimizer_factory",
    )
    parser.add_argument("--bf16", action="store_true", help="DeepSpeed bf16 (pipeline run only)")
    parser.add_argument("--activation-checkpoint-interval", type=int, default=0)
    parser.add_argument("--hf-gradient-checkpointing", action="store_true")
    parser.add_argument("--export", help="export the trained model to this folder")
    parser.add_argument("--save-to", help="save a DeepSpeed checkpoint here before step --save-at")
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--resume-from", help="resume from the DeepSpeed checkpoint in this folder")
    parser.add_argument("--tag", default="step")
    parser.add_argument("--out", required=True, help="JSON results (rank 0 writes)")
    args = parser.parse_args(argv)

    result = run_reference(args) if args.reference else run_pipeline(args)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
