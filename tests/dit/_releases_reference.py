"""Independent float64 re-computations of the releases' forward passes (LightningDiT, DDT, RAE's DiT-DH), written
from their facts (dit/lightningdit.py, dit/ddt.py, dit/ditdh.py docstrings) with explicit formulas and loops, on a
state_dict, so the tests share no code path with dit/."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def lin(sd, name, x):
    out = x @ sd[name + ".weight"].T
    return out + sd[name + ".bias"] if name + ".bias" in sd else out


def rms(x, w, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layer_norm(x, eps=1e-6):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps)


def sinusoid(t, max_period, dim=256):
    half = dim // 2
    freqs = torch.tensor([math.exp(-math.log(max_period) * k / half) for k in range(half)], dtype=torch.float64)
    args = t.double()[:, None] * freqs
    return torch.cat([args.cos(), args.sin()], dim=-1)


def eva_angle(r, c, j, hd):
    """EVA's layout: pairs j < hd/4 turn with the row r, the others with the column c; freq 10000^(-k/(hd/4))."""
    quarter = hd // 4
    return (r if j < quarter else c) * 10000.0 ** (-(j % quarter) / quarter)


def ddt_angle(r, c, j, hd, grid):
    """DDT's layout: positions 16 * i / (grid - 1); pair 2k turns with the column, 2k+1 with the row."""
    pos = [16.0 * i / (grid - 1) for i in range(grid)]
    k, axis = j // 2, j % 2
    return (pos[c] if axis == 0 else pos[r]) * 10000.0 ** (-4 * k / hd)


def rotate(x, angle_of, grid, prefix=0):
    """x [N, H, T, hd]: feature pair (2j, 2j+1) of token prefix + r*grid+c turned by angle_of(r, c, j); the first
    `prefix` tokens (JiT's in-context tokens) are not turned."""
    out = x.clone()
    hd = x.shape[-1]
    for i in range(grid * grid):
        r, c = divmod(i, grid)
        tok = prefix + i
        for j in range(hd // 2):
            w = angle_of(r, c, j)
            a, b = x[..., tok, 2 * j], x[..., tok, 2 * j + 1]
            out[..., tok, 2 * j] = a * math.cos(w) - b * math.sin(w)
            out[..., tok, 2 * j + 1] = a * math.sin(w) + b * math.cos(w)
    return out


def attention(sd, p, x, heads, angle_of=None, grid=None, qk=None, prefix=0):
    n, tokens, d = x.shape
    hd = d // heads
    qkv = lin(sd, p + "qkv", x).reshape(n, tokens, 3, heads, hd)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [N, H, T, hd]
    if qk is not None:
        q, k = qk(q, sd[p + "q_norm.weight"]), qk(k, sd[p + "k_norm.weight"])
    if angle_of is not None:
        q, k = rotate(q, angle_of, grid, prefix), rotate(k, angle_of, grid, prefix)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)
    return lin(sd, p + "proj", (w @ v).transpose(1, 2).reshape(n, tokens, d))


def mlp(sd, p, x):
    if p + "w12.weight" in sd:  # SwiGLU: silu(first half) * second half, then w3
        a, b = lin(sd, p + "w12", x).chunk(2, dim=-1)
        return lin(sd, p + "w3", a * torch.sigmoid(a) * b)
    if p + "w1.weight" in sd:  # LLaMA: w2(silu(w1 x) * w3 x)
        a = lin(sd, p + "w1", x)
        return lin(sd, p + "w2", a * torch.sigmoid(a) * lin(sd, p + "w3", x))
    return lin(sd, p + "fc2", F.gelu(lin(sd, p + "fc1", x), approximate="tanh"))


def block(sd, p, x, c, heads, *, silu_mod, angle_of=None, grid=None, qk=None, prefix=0):
    """adaLN-Zero; c [N, D] or [N, T, D]; learned RMSNorm when the block has norm scales, else LayerNorm."""
    cc = c * torch.sigmoid(c) if silu_mod else c
    key = p + ("adaLN_modulation.1" if silu_mod else "adaLN_modulation.0")
    mod = lin(sd, key, cc)
    mod = mod[:, None] if mod.dim() == 2 else mod
    d = x.shape[-1]
    if mod.shape[-1] == 6 * d:
        sh1, sc1, g1, sh2, sc2, g2 = mod.chunk(6, dim=-1)
    else:  # wo_shift
        sc1, g1, sc2, g2 = mod.chunk(4, dim=-1)
        sh1 = sh2 = 0
    norm1 = (lambda h: rms(h, sd[p + "norm1.weight"])) if p + "norm1.weight" in sd else layer_norm
    norm2 = (lambda h: rms(h, sd[p + "norm2.weight"])) if p + "norm2.weight" in sd else layer_norm
    x = x + g1 * attention(sd, p + "attn.", norm1(x) * (1 + sc1) + sh1, heads, angle_of, grid, qk, prefix)
    return x + g2 * mlp(sd, p + "mlp.", norm2(x) * (1 + sc2) + sh2)


def final(sd, x, c, *, silu_mod):
    cc = c * torch.sigmoid(c) if silu_mod else c
    mod = lin(sd, "final_layer.adaLN_modulation." + ("1" if silu_mod else "0"), cc)
    mod = mod[:, None] if mod.dim() == 2 else mod
    shift, scale = mod.chunk(2, dim=-1)
    w = sd.get("final_layer.norm_final.weight")
    h = rms(x, w) if w is not None else layer_norm(x)
    return lin(sd, "final_layer.linear", h * (1 + scale) + shift)


def patchify(x, p):
    """[N, C, S, S] -> [N, g*g, C*p*p], feature c*p*p + a*p + b of token i*g + j = x[c, i*p + a, j*p + b]."""
    n, ch, s, _ = x.shape
    g = s // p
    return x.reshape(n, ch, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, ch * p * p)


def unfold_back(tok, ch, p, g):
    """Inverse of patchify."""
    n = tok.shape[0]
    return tok.reshape(n, g, g, ch, p, p).permute(0, 3, 1, 4, 2, 5).reshape(n, ch, g * p, g * p)


def unpatchify_dit(tok, ch, p, g):
    """DiT's order: feature (a*p + b)*C + c."""
    n = tok.shape[0]
    return tok.reshape(n, g, g, p, p, ch).permute(0, 5, 1, 3, 2, 4).reshape(n, ch, g * p, g * p)


def conv_embed(sd, name, x, p):
    """A Conv2d patch embedding as the matrix it is: token features (c, a, b) against weight [D, C, p, p]."""
    n, ch = x.shape[:2]
    g = x.shape[-1] // p
    tokens = x.reshape(n, ch, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, ch * p * p)
    return tokens @ sd[name + ".weight"].reshape(sd[name + ".weight"].shape[0], -1).T + sd[name + ".bias"]


def _mlp_t(sd, features):
    return lin(sd, "t_embedder.mlp.2", F.silu(lin(sd, "t_embedder.mlp.0", features)))


def lightningdit_forward(sd, cfg, x, t, y):
    sd = {k: v.double() for k, v in sd.items()}
    p, heads, grid = cfg["patch_size"], cfg["num_heads"], cfg["input_size"] // cfg["patch_size"]
    hd = cfg["hidden_size"] // heads
    angle = (lambda r, c, j: eva_angle(r, c, j, hd)) if cfg["rope"] else None
    qk = (rms if cfg["rms_norm"] else None) if cfg["qk_norm"] else None
    h = conv_embed(sd, "x_embedder.proj", x.double(), p) + sd["pos_embed"]
    c = _mlp_t(sd, sinusoid(t, 10000.0)) + sd["y_embedder.embedding_table.weight"][y]
    for i in range(cfg["depth"]):
        h = block(sd, f"blocks.{i}.", h, c, heads, silu_mod=True, angle_of=angle, grid=grid, qk=qk)
    out_ch = cfg["in_channels"] * (2 if cfg["learn_sigma"] else 1)
    return unpatchify_dit(final(sd, h, c, silu_mod=True), out_ch, p, grid)


def ddt_forward(sd, cfg, x, t, y):
    sd = {k: v.double() for k, v in sd.items()}
    p, heads, grid, enc = cfg["patch_size"], cfg["num_heads"], cfg["input_size"] // cfg["patch_size"], cfg["encoder_depth"]
    hd = cfg["hidden_size"] // heads
    angle = lambda r, c, j: ddt_angle(r, c, j, hd, grid)  # noqa: E731
    patches = patchify(x.double(), p)
    temb = _mlp_t(sd, sinusoid(t, 10.0))[:, None]
    cond = F.silu(temb + sd["y_embedder.embedding_table.weight"][y][:, None])
    s = lin(sd, "s_embedder.proj", patches)
    for i in range(enc):
        s = block(sd, f"blocks.{i}.", s, cond, heads, silu_mod=False, angle_of=angle, grid=grid, qk=rms)
    s = F.silu(temb + s)
    h = lin(sd, "x_embedder.proj", patches)
    for i in range(enc, cfg["depth"]):
        h = block(sd, f"blocks.{i}.", h, s, heads, silu_mod=False, angle_of=angle, grid=grid, qk=rms)
    return unfold_back(final(sd, h, s, silu_mod=False), cfg["in_channels"] * (2 if cfg["learn_sigma"] else 1), p, grid)


def ditdh_forward(sd, cfg, x, t, y):
    sd = {k: v.double() for k, v in sd.items()}
    p, grid = cfg["patch_size"], cfg["input_size"] // cfg["patch_size"]
    he, hh = cfg["num_heads"], cfg["head_num_heads"]
    hde, hdh = cfg["hidden_size"] // he, cfg["head_hidden_size"] // hh
    enc_angle = (lambda r, c, j: eva_angle(r, c, j, hde)) if cfg["rope"] else None
    dec_angle = (lambda r, c, j: eva_angle(r, c, j, hdh)) if cfg["rope"] else None
    args = t.double()[:, None] * sd["t_embedder.W"][None] * 2 * math.pi
    temb = _mlp_t(sd, torch.cat([args.sin(), args.cos()], dim=-1))  # Gaussian Fourier: sin first
    c = F.silu(temb + sd["y_embedder.embedding_table.weight"][y])
    s = conv_embed(sd, "s_embedder.proj", x.double(), p) + sd["pos_embed"]
    for i in range(cfg["depth"]):
        s = block(sd, f"blocks.{i}.", s, c, he, silu_mod=True, angle_of=enc_angle, grid=grid)
    s = F.silu(temb[:, None] + s)
    if "s_projector.weight" in sd:
        s = lin(sd, "s_projector", s)
    h = conv_embed(sd, "x_embedder.proj", x.double(), p)
    for i in range(cfg["depth"], cfg["depth"] + cfg["head_depth"]):
        h = block(sd, f"blocks.{i}.", h, s, hh, silu_mod=True, angle_of=dec_angle, grid=grid)
    out_ch = cfg["in_channels"] * (2 if cfg["learn_sigma"] else 1)
    return unpatchify_dit(final(sd, h, s, silu_mod=True), out_ch, p, grid)


def jit_forward(sd, cfg, x, t, y):
    """JiT (LTH14/JiT model_jit.py, as dit/jit.py states it): LightningDiT's blocks with RMSNorm QK-norm; the patch
    embedding proj2(proj1(x)) (p x p without bias to the bottleneck, then 1 x 1 with bias); before block
    in_context_start, in_context_len copies of the class embedding plus in_context_posemb in front, not rotated;
    the final layer on the image tokens."""
    sd = {k: v.double() for k, v in sd.items()}
    p, heads, grid = cfg["patch_size"], cfg["num_heads"], cfg["input_size"] // cfg["patch_size"]
    hd, d, b = cfg["hidden_size"] // heads, cfg["hidden_size"], cfg["bottleneck_dim"]
    angle = lambda r, c, j: eva_angle(r, c, j, hd)  # noqa: E731
    low = patchify(x.double(), p) @ sd["x_embedder.proj1.weight"].reshape(b, -1).T  # no bias
    h = low @ sd["x_embedder.proj2.weight"].reshape(d, b).T + sd["x_embedder.proj2.bias"] + sd["pos_embed"]
    y_emb = sd["y_embedder.embedding_table.weight"][y]
    c = _mlp_t(sd, sinusoid(t, 10000.0)) + y_emb
    prefix = 0
    for i in range(cfg["depth"]):
        if i == cfg["in_context_start"] and cfg["in_context_len"]:
            prefix = cfg["in_context_len"]
            h = torch.cat([y_emb[:, None] + sd["in_context_posemb"], h], dim=1)
        h = block(sd, f"blocks.{i}.", h, c, heads, silu_mod=True, angle_of=angle, grid=grid, qk=rms, prefix=prefix)
    return unpatchify_dit(final(sd, h[:, prefix:], c, silu_mod=True), cfg["in_channels"], p, grid)
