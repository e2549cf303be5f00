"""Where two SSE implementations' training steps part: a small SSE-H model's loss and parameter gradients on one
path against another's, per parameter, with each SSE layer's top-1 route flips between the two, and the operator
of every call replayed on that call's own inputs against the float64 reference.

    python bench/model_step_paths.py [--pads 0 37] [--seed 0] [--impl auto] [--against chunk_torch_varlen]
    TRITON_F32_DEFAULT=ieee python bench/model_step_paths.py      # float32 dots without tf32 rounding
    TRITON_INTERPRET=1 python bench/model_step_paths.py --impl triton_indexed --width 64 --tokens 40    # on a CPU

Made for a left-padded GPU step whose second router's gradient came out 7.7 % from the torch path's: one token of
363 took another top-1 partition on the two paths, which tf32 dots had moved across a near-tie (kernels/NOTES.md,
2026-11-29). Row 1 of the batch of two gets `--pads` left pad tokens. Prints a report; writes nothing.
"""
import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kernels  # noqa: E402
from kernels import dispatch  # noqa: E402

OPERATOR_INPUTS = ["q", "k_logits", "v", "log_decay", "router_logits", "q_shared", "k_shared_logits"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; inf where either holds a NaN or inf."""
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def small_model(width: int, device: str, seed: int):
    """The SSE-H of tests/test_triton_kernels.py's model-step test (which builds it here): two SSE layers (n4k1 +
    shared, LoRA 16), then attention; float32."""
    from sse_model import SSEConfig, SSEForCausalLM
    config = SSEConfig(vocab_size=512, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=3,
                       layer_types=["linear_attention", "linear_attention", "full_attention"],
                       num_attention_heads=2, head_dim=width // 2, sse_num_partitions=4, sse_top_k=1,
                       sse_lora_rank=16)
    torch.manual_seed(seed)
    return SSEForCausalLM(config).to(device)


def train_step(model, ids, mask, impl: str) -> dict:
    """Loss, parameter gradients by name and every SSE operator call's (inputs, output with its gradient)."""
    calls = []
    operator = kernels.sse_attention

    def recorded(**inputs):
        o, final = operator(**inputs)
        if o.requires_grad:
            o.retain_grad()
        calls.append((inputs, o))
        return o, final
    model.config.sse_impl = impl
    model.zero_grad()
    kernels.sse_attention = recorded  # the SSE layers call it through the package
    try:
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
    finally:
        kernels.sse_attention = operator
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(loss=loss.detach(), grads=grads, calls=calls)


def replay(inputs: dict, dout: torch.Tensor, impl: str, dtype: torch.dtype, same_strides: bool):
    """The operator alone on a call's inputs (with their strides, or contiguous copies): (o, gradients by input)."""
    args, leaves = dict(inputs, impl=impl), {}
    for name in OPERATOR_INPUTS:
        t = inputs.get(name)
        if t is None:
            continue
        t = t.detach().to(dtype)
        leaf = torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=t.device) if same_strides else \
            torch.empty_like(t, memory_format=torch.contiguous_format)
        leaves[name] = args[name] = leaf.copy_(t).requires_grad_(name != "router_logits")
    o, _ = dispatch.sse_attention(**args)
    names = [n for n, leaf in leaves.items() if leaf.requires_grad]
    grads = torch.autograd.grad(o, [leaves[n] for n in names], dout.to(o.dtype))
    return o.detach(), dict(zip(names, grads))


def compare(width: int, tokens: int, pads: int, seed: int, impl: str, against: str, device: str) -> dict:
    """The two steps compared: loss, gradients per parameter, and per SSE call the route flips, the outputs at
    real tokens, and `impl` and `against` replayed on `impl`'s inputs against the float64 reference."""
    model = small_model(width, device, seed)
    ids = torch.randint(0, model.config.vocab_size, (2, tokens), device=device)
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    real = mask.bool()
    a, b = train_step(model, ids, mask, impl), train_step(model, ids, mask, against)
    report = dict(loss=rel(a["loss"], b["loss"]), grads=sorted(((rel(g, b["grads"][n]), n) for n, g in
                                                                 a["grads"].items()), reverse=True), calls=[])
    for (inputs, o), (inputs_b, o_b) in zip(a["calls"], b["calls"]):
        (logits, top), top_b = inputs["router_logits"].detach().topk(2, -1), inputs_b["router_logits"].argmax(-1)
        reference, reference_grads = replay(inputs, o.grad, "reference", torch.float64, same_strides=False)
        replayed = {}
        for name, same_strides in ((impl, True), (impl, False), (against, False)):
            if name == "auto":
                name = dispatch.pick_implementation(o.device, model.config.sse_top_k,
                                                    model.config.sse_num_partitions)
            out, grads = replay(inputs, o.grad, name, torch.float32, same_strides)
            replayed[f"{name}{'' if same_strides else ' (contiguous)'}"] = dict(
                o=rel(out[real], reference[real]), **{f"d{n}": rel(g, reference_grads[n]) for n, g in grads.items()})
        report["calls"].append(dict(
            flips=int(((top[..., 0] != top_b) & real).sum()), tokens=int(real.sum()),
            margin=float((logits[..., 0] - logits[..., 1])[real].min()), o=rel(o[real], o_b[real]),
            dout=rel(o.grad, o_b.grad), inputs=max(rel(inputs[n][real], inputs_b[n][real])
                                                   for n in OPERATOR_INPUTS if inputs.get(n) is not None),
            replayed=replayed))
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pads", type=int, nargs="+", default=[0, 37], help="left pad tokens of row 1, one step each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--impl", default="auto")
    p.add_argument("--against", default="chunk_torch_varlen")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for pads in args.pads:
        r = compare(args.width, args.tokens, pads, args.seed, args.impl, args.against, device)
        print(f"\n== {pads} pads, seed {args.seed}: {args.impl} against {args.against}, loss {r['loss']:.1e}, "
              f"gradients (largest first):")
        for err, name in r["grads"][:6]:
            print(f"  {err:.1e}  {name}")
        for i, call in enumerate(r["calls"]):
            print(f"  SSE call {i}: {call['flips']} of {call['tokens']} tokens routed otherwise (smallest top-2 "
                  f"margin {call['margin']:.1e}); inputs {call['inputs']:.1e}, output {call['o']:.1e}, output's "
                  f"gradient {call['dout']:.1e} apart")
            for name, errors in call["replayed"].items():
                print(f"    replayed {name} against float64: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
