"""Independent float64 re-computations of the published DiT definitions (docs/REFERENCE.md), written
with plain loops and explicit formulas so the tests do not share code paths with dit/."""
from __future__ import annotations

import math

import torch

from dit_pipeline import dit

TINY = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2,
            num_classes=5, class_dropout_prob=0.1, learn_sigma=True)


def tiny_model(seed: int = 0, randomize: bool = True, **overrides) -> dit.DiT:
    """A depth-2, width-32 DiT; `randomize` replaces the zero init so the output is not trivially 0."""
    torch.manual_seed(seed)
    model = dit.DiT(**{**TINY, **overrides})
    if randomize:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name != "pos_embed":
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def calm_model(seed: int = 4) -> dit.DiT:
    """tiny_model with the zero-initialised layers small, as in a trained model: outputs of order 1."""
    model = tiny_model(seed=seed).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer.linear" in name:
                p.mul_(0.1)
    return model


def ref_timestep_embedding(t: float, dim: int = 256) -> list[float]:
    half = dim // 2
    args = [t * math.exp(-math.log(10000.0) * k / half) for k in range(half)]
    return [math.cos(a) for a in args] + [math.sin(a) for a in args]


def ref_pos_embed(dim: int, grid: int) -> torch.Tensor:
    """[grid*grid, dim]: token r*grid+c; first half encodes c, second half r; sin half first."""
    quarter = dim // 4
    table = torch.zeros(grid * grid, dim, dtype=torch.float64)
    for r in range(grid):
        for c in range(grid):
            for k in range(quarter):
                omega = 1.0 / 10000 ** (k / quarter)
                table[r * grid + c, k] = math.sin(c * omega)
                table[r * grid + c, quarter + k] = math.cos(c * omega)
                table[r * grid + c, 2 * quarter + k] = math.sin(r * omega)
                table[r * grid + c, 3 * quarter + k] = math.cos(r * omega)
    return table


def _linear(sd, name, x):
    return x @ sd[name + ".weight"].T + sd[name + ".bias"]


def _layer_norm(x, eps=1e-6):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x):
    return x / (1 + torch.exp(-x))


def ref_forward(model: dit.DiT, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                hidden_after: int | None = None):
    """The DiT forward of docs/REFERENCE.md in float64 with the model's weights (labels used as given);
    with `hidden_after=k` also the tokens after block k: (out, hidden [N, T, D])."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    cfg = model.config
    n, p, d, heads = x.shape[0], cfg["patch_size"], cfg["hidden_size"], cfg["num_heads"]
    g = cfg["input_size"] // p
    x = x.double()
    # patch embedding as an explicit dot product per patch, tokens row-major
    tokens = torch.zeros(n, g * g, d, dtype=torch.float64)
    w = sd["x_embedder.proj.weight"].reshape(d, -1)
    for i in range(g):
        for j in range(g):
            patch = x[:, :, i * p:(i + 1) * p, j * p:(j + 1) * p].reshape(n, -1)
            tokens[:, i * g + j] = patch @ w.T + sd["x_embedder.proj.bias"]
    h = tokens + sd["pos_embed"]
    temb = torch.tensor([ref_timestep_embedding(float(v)) for v in t], dtype=torch.float64)
    temb = _linear(sd, "t_embedder.mlp.2", _silu(_linear(sd, "t_embedder.mlp.0", temb)))
    c = temb + sd["y_embedder.embedding_table.weight"][y]
    hd = d // heads
    for b in range(cfg["depth"]):
        pre = f"blocks.{b}."
        mod = _linear(sd, pre + "adaLN_modulation.1", _silu(c))
        sh1, sc1, g1, sh2, sc2, g2 = [mod[:, k * d:(k + 1) * d, None].transpose(1, 2) for k in range(6)]
        a = _layer_norm(h) * (1 + sc1) + sh1
        qkv = _linear(sd, pre + "attn.qkv", a)  # [N, T, 3D] laid out [3, heads, hd]
        heads_out = []
        for hh in range(heads):
            q = qkv[..., hh * hd:(hh + 1) * hd]
            k = qkv[..., d + hh * hd:d + (hh + 1) * hd]
            v = qkv[..., 2 * d + hh * hd:2 * d + (hh + 1) * hd]
            heads_out.append(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), dim=-1) @ v)
        h = h + g1 * _linear(sd, pre + "attn.proj", torch.cat(heads_out, dim=-1))
        m = _layer_norm(h) * (1 + sc2) + sh2
        h = h + g2 * _linear(sd, pre + "mlp.fc2", _gelu_tanh(_linear(sd, pre + "mlp.fc1", m)))
        if b + 1 == hidden_after:
            hidden = h.clone()
    mod = _linear(sd, "final_layer.adaLN_modulation.1", _silu(c))
    shift, scale = mod[:, None, :d], mod[:, None, d:]
    out_tok = _linear(sd, "final_layer.linear", _layer_norm(h) * (1 + scale) + shift)
    cout = out_tok.shape[-1] // (p * p)
    out = torch.zeros(n, cout, g * p, g * p, dtype=torch.float64)
    for i in range(g):
        for j in range(g):
            for a_ in range(p):
                for b_ in range(p):
                    for ch in range(cout):
                        out[:, ch, i * p + a_, j * p + b_] = out_tok[:, i * g + j, (a_ * p + b_) * cout + ch]
    return out if hidden_after is None else (out, hidden)
