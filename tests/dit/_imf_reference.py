"""The iMF release (Lyy-iiis/imeanflow, main branch at bf60cd7) written out from its JAX code, line by line, as torch
functions on its flax parameter tree (nested dicts named as flax names imfDiT's modules; Dense kernels [in, out],
the patch conv's kernel [p, p, C, D]) and on NHWC images as the release's: the network (models/imfDiT.py,
models/embedder.py, models/torch_models.py), its loss (imf.py `iMeanFlow.forward`, `guidance_fn`, `cond_drop`) and
its PyTorch branch's file layout (convert.py's renaming, commit a2ac5c55). Nothing here imports dit_pipeline.dit."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

PREFIX = ("class_tokens", "omega_tokens", "t_min_tokens", "t_max_tokens", "time_tokens")  # imfDiT.py 311-321


def dense(p, x):
    """torch_models.py TorchLinear (7-41): flax nn.Dense, x @ kernel [+ bias]."""
    q = p["_flax_linear"]
    out = x @ q["kernel"]
    return out + q["bias"] if "bias" in q else out


def rms_norm(p, x, eps=1e-6):
    """torch_models.py RMSNorm (73-88): x / sqrt(mean(x^2) + eps), times the `kernel` parameter."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * p["kernel"]


def timestep_embedder(p, t):
    """embedder.py TimestepEmbedder (32-51): [cos, sin] of t * exp(-ln(10000) k / 128), then Dense, silu, Dense."""
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half).to(t.dtype)
    args = t[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return dense(p["mlp"]["layers_2"], F.silu(dense(p["mlp"]["layers_0"], emb)))


def patch_embed(p, x, patch):
    """embedder.py PatchEmbedder (74-110): a flax Conv with kernel = stride = p ('SAME' adds no padding then),
    NHWC -> [N, (H/p)(W/p), D] row-major."""
    n, h, w, c = x.shape
    cells = x.reshape(n, h // patch, patch, w // patch, patch, c).permute(0, 1, 3, 2, 4, 5)  # [N, gh, gw, p, p, C]
    out = torch.einsum("nijabc,abcd->nijd", cells, p["proj"]["kernel"]) + p["proj"]["bias"]
    return out.reshape(n, -1, out.shape[-1])


def rope(x, positions, head_dim):
    """imfDiT.py precompute_rope_freqs / apply_rotary_pos_emb (370-385): consecutive pairs as complex numbers times
    exp(i pos theta^(-2j/hd)), in float32 or wider."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)  # [L, hd/2]
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).to(torch.float64).contiguous())  # [N, L, H, hd/2]
    return torch.view_as_real(xc * rot[None, :, None, :]).reshape(x.shape).to(x.dtype)


def attention(p, x, heads):
    """imfDiT.py RoPEAttention (22-65) with flax's dot_product_attention: softmax(q k / sqrt(d)) v."""
    n, length, dim = x.shape
    hd = dim // heads
    q, k, v = (dense(p[name], x).reshape(n, length, heads, hd) for name in ("q_proj", "k_proj", "v_proj"))
    q, k = rope(rms_norm(p["q_norm"], q), length, hd), rope(rms_norm(p["k_norm"], k), length, hd)
    weights = torch.softmax(torch.einsum("nqhd,nkhd->nhqk", q / math.sqrt(hd), k), dim=-1)
    return dense(p["out_proj"], torch.einsum("nhqk,nkhd->nqhd", weights, v).reshape(n, length, dim))


def block(p, x, heads):
    """imfDiT.py TransformerBlock (68-105), SwiGLUMlp (torch_models.py 91-112)."""
    x = x + attention(p["attn"], rms_norm(p["norm1"], x), heads) * p["attn_scale"]
    h = rms_norm(p["norm2"], x)
    return x + dense(p["mlp"]["w2"], F.silu(dense(p["mlp"]["w1"], h)) * dense(p["mlp"]["w3"], h)) * p["mlp_scale"]


def imf_dit(net, x, t, h, w, t_min, t_max, y, *, heads, patch):
    """imfDiT.__call__ (325-362): (u, v) NHWC; the network reads h, never t (342)."""
    embeds = {"class_tokens": net["y_embedder"]["embedding_table"]["_flax_embedding"]["embedding"][y],
              "omega_tokens": timestep_embedder(net["omega_embedder"], 1 - 1 / w),
              "t_min_tokens": timestep_embedder(net["cfg_t_start_embedder"], t_min),
              "t_max_tokens": timestep_embedder(net["cfg_t_end_embedder"], t_max),
              "time_tokens": timestep_embedder(net["h_embedder"], h)}
    seq = torch.cat([*(net[name][None] + embeds[name][:, None] for name in PREFIX), patch_embed(net["x_embedder"], x,
                                                                                                 patch)], dim=1)
    prefix = sum(net[name].shape[0] for name in PREFIX)
    stacks = {s: sorted((k for k in net if k.startswith(s + "_")), key=lambda k: int(k.rsplit("_", 1)[1]))
              for s in ("shared_blocks", "u_heads", "v_heads")}
    for name in stacks["shared_blocks"]:
        seq = block(net[name], seq, heads)
    outs = []
    for stack, final in (("u_heads", "u_final_layer"), ("v_heads", "v_final_layer")):
        s = seq
        for name in stacks[stack]:
            s = block(net[name], s, heads)
        tokens = dense(net[final]["linear"], rms_norm(net[final]["norm"], s[:, prefix:]))
        n, length, features = tokens.shape
        g, c = int(length ** 0.5), features // (patch * patch)
        img = torch.einsum("nhwpqc->nhpwqc", tokens.reshape(n, g, g, patch, patch, c))  # unpatchify (269-278)
        outs.append(img.reshape(n, g * patch, g * patch, c))
    return outs[0], outs[1]


def imf_loss(net, images, labels, t, r, fm_mask, e, t_min, t_max, omega, drop_uniform, *, heads, patch,
             num_classes, class_dropout_prob=0.1, norm_p=1.0, norm_eps=0.01):
    """imf.py iMeanFlow.forward (331-401) with its draws given: t, r, t_min, t_max, omega [N] (sample_tr,
    sample_cfg_interval, sample_cfg_scale), e the noise, drop_uniform the uniforms of cond_drop. Returns the loss
    (mean over the batch of loss_u + loss_v, each adaptively weighted) and the dict of its monitors."""
    b4 = lambda s: s.reshape(-1, 1, 1, 1)  # noqa: E731  the release's [bz, 1, 1, 1] shapes
    bz = images.shape[0]

    def u_fn(x, t_, h_, w_, lo, hi, y):  # 185-210
        return imf_dit(net, x, t_, h_, w_, lo, hi, y, heads=heads, patch=patch)

    def v_cond_fn(x, t_, w_, y):  # 212-233: h, t_min, t_max dummy (0, 0, 1); the v head
        return u_fn(x, t_, torch.zeros_like(t_), w_, torch.zeros_like(t_), torch.ones_like(t_), y)[1]

    x = images
    z_t = (1 - b4(t)) * x + b4(t) * e  # 350
    v_t = e - x
    # guidance_fn (295-325) with v_fn (235-261): [cond; uncond] at (omega, 1)
    out = v_cond_fn(torch.cat([z_t, z_t]), torch.cat([t, t]), torch.cat([omega, torch.ones_like(omega)]),
                    torch.cat([labels, torch.full_like(labels, num_classes)]))
    v_c, v_u = out[:bz], out[bz:]
    v_g_fm = v_t + b4(1 - 1 / omega) * (v_c - v_u)
    w = torch.where((t >= t_min) & (t <= t_max), omega, torch.ones_like(omega))
    v_c = v_cond_fn(z_t, t, w, labels)
    v_g = v_t + b4(1 - 1 / w) * (v_c - v_u)
    v_g = torch.where(b4(fm_mask), v_g_fm, v_g)
    # cond_drop (263-293): the FIRST k samples, k = #(u < p)
    num_drop = int((drop_uniform < class_dropout_prob).sum())
    drop_mask = torch.arange(bz) < num_drop
    labels = torch.where(drop_mask, num_classes, labels)
    v_g = torch.where(b4(drop_mask), v_t, v_g)

    def u_t_r(z, t_, r_):  # 366-367, the JVP along (v_c, 1, 0) with v as aux (373)
        u, v = u_fn(z, t_, t_ - r_, omega, t_min, t_max, labels)
        return u, v

    u, du_dt, v = torch.func.jvp(u_t_r, (z_t, t, r), (v_c.detach(), torch.ones_like(t), torch.zeros_like(t)),
                                 has_aux=True)
    big_v = u + b4(t - r) * du_dt.detach()  # 376
    v_g = v_g.detach()

    def adp(loss):  # 380-382
        return loss / ((loss + norm_eps) ** norm_p).detach()

    loss_u = adp(((big_v - v_g) ** 2).sum(dim=(1, 2, 3)))
    loss_v = adp(((v - v_g) ** 2).sum(dim=(1, 2, 3)))
    return (loss_u + loss_v).mean(), {"loss_u": ((big_v - v_g) ** 2).mean(), "loss_v": ((v - v_g) ** 2).mean()}


# ------------------------------------------------------------------------------------------------------------------
# the parameter tree and the release's file layouts

def random_tree(rng: np.random.Generator, *, hidden, heads, patch, channels, num_classes, shared, head_depth,
                tokens=(8, 4, 2, 4), scale=0.3, v_heads=True):
    """A flax parameter tree of imfDiT (`net`) with random values: the module names of imfDiT.setup (162-267),
    embedder.py and torch_models.py (Sequential children layers_i, list members name_i, TorchLinear's _flax_linear,
    TorchEmbedding's _flax_embedding, RMSNorm's `kernel`)."""
    def arr(*shape, s=scale):
        return (s * rng.standard_normal(shape)).astype(np.float32)

    def lin(i, o, bias=True):
        return {"_flax_linear": {"kernel": arr(i, o, s=scale / math.sqrt(i) * 4), **({"bias": arr(o)} if bias else {})}}

    def temb():
        return {"mlp": {"layers_0": lin(256, hidden), "layers_2": lin(hidden, hidden)}}

    def norm(d):
        return {"kernel": (1 + arr(d)).astype(np.float32)}

    hd, width = hidden // heads, int(hidden * 8 / 3)

    def blk():
        attn = {n: lin(hidden, hidden, bias=False) for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
        attn.update(q_norm=norm(hd), k_norm=norm(hd))
        return {"norm1": norm(hidden), "norm2": norm(hidden), "attn": attn, "attn_scale": arr(hidden),
                "mlp_scale": arr(hidden), "mlp": {"w1": lin(hidden, width, False), "w3": lin(hidden, width, False),
                                                  "w2": lin(width, hidden, False)}}

    n_class, n_cfg, n_interval, n_time = tokens
    net = {"x_embedder": {"proj": {"kernel": arr(patch, patch, channels, hidden), "bias": arr(hidden)}},
           "h_embedder": temb(), "omega_embedder": temb(), "cfg_t_start_embedder": temb(), "cfg_t_end_embedder": temb(),
           "y_embedder": {"embedding_table": {"_flax_embedding": {"embedding": arr(num_classes + 1, hidden)}}},
           "time_tokens": arr(n_time, hidden), "class_tokens": arr(n_class, hidden), "omega_tokens": arr(n_cfg, hidden),
           "t_min_tokens": arr(n_interval, hidden), "t_max_tokens": arr(n_interval, hidden),
           "u_final_layer": {"norm": norm(hidden), "linear": lin(hidden, patch * patch * channels)},
           "v_final_layer": {"norm": norm(hidden), "linear": lin(hidden, patch * patch * channels)}}
    for i in range(shared):
        net[f"shared_blocks_{i}"] = blk()
    for i in range(head_depth):
        net[f"u_heads_{i}"] = blk()
        if v_heads:
            net[f"v_heads_{i}"] = blk()
    return net


def flatten(tree, sep="/", prefix=""):
    """flax.traverse_util.flatten_dict(tree, sep=sep)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{sep}{k}" if prefix else k
        out.update(flatten(v, sep, key) if isinstance(v, dict) else {key: v})
    return out


def to_torch(tree, dtype=torch.float64, requires_grad=False):
    return {k: to_torch(v, dtype, requires_grad) if isinstance(v, dict) else
            torch.tensor(v, dtype=dtype, requires_grad=requires_grad) for k, v in tree.items()}


def torch_branch_state_dict(net):
    """The release's PyTorch file (its torch branch's convert.py `dfs`, commit a2ac5c55): the tree {"net": ...} with
    `layers_i` -> `i`, a trailing `_<digits>` -> `.<digits>`, `kernel` -> `weight` (Dense transposed, the conv under
    x_embedder permuted (3, 2, 0, 1), a norm's kept), `embedding` -> `weight`; the v heads removed first (as its
    __main__ does for the inference files)."""
    out = {}

    def dfs(node, names, buffs):
        if not isinstance(node, dict):
            a = node
            if "flip" in buffs and "norm" not in buffs:
                a = np.transpose(a, (3, 2, 0, 1)) if "conv" in buffs else a.T  # HWIO -> OIHW; [in, out] -> [out, in]
            out[".".join(names)] = torch.from_numpy(np.ascontiguousarray(a))
            return
        for k, v in node.items():
            more = set(buffs)
            if "layers_" in k:
                name = k.replace("layers_", "")
            elif len(k.split("_")) >= 2 and k.split("_")[-1].isdigit():
                name = "_".join(k.split("_")[:-1]) + "." + k.split("_")[-1]
            elif k in ("scale", "embedding"):
                name = "weight"
            elif k == "kernel":
                name = "weight"
                more.add("flip")
            else:
                name = k
            if k == "x_embedder":
                more.add("conv")
            elif "norm" in k:
                more.add("norm")
            dfs(v, [*names, name], more)

    dfs({"net": {k: v for k, v in net.items() if not k.startswith("v_heads")}}, [], set())
    return out
