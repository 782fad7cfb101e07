"""A naive DAB-DETR / DN-DETR written from the papers (Liu et al. ICLR 2022; Li et al.
CVPR 2022) and docs/model.md, for the tests.

Independent of the package code: it reads the weights by their public key names from a
dict, and computes every step with explicit formulas, one attention head at a time, in
the dtype of the weights (float64 in the tests). It starts from what the backbone hands
over (features, padding mask, position encoding); the backbone is DETR's, tested
elsewhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

EPS = 1e-3  # clamp of the inverse sigmoid


def linear(w: dict, name: str, x: Tensor) -> Tensor:
    return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]


def mlp(w: dict, name: str, x: Tensor, layers: int) -> Tensor:
    for i in range(layers):
        x = linear(w, f"{name}.layers.{i}", x)
        if i < layers - 1:
            x = torch.clamp(x, min=0)
    return x


def layer_norm(w: dict, name: str, x: Tensor, eps: float = 1e-5) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w[f"{name}.weight"] + w[f"{name}.bias"]


def prelu(w: dict, name: str, x: Tensor) -> Tensor:
    slope = w[f"{name}.weight"]
    return torch.where(x >= 0, x, slope * x)


def logit(p: Tensor) -> Tensor:
    p = torch.clamp(p, 0.0, 1.0)
    return torch.log(torch.clamp(p, min=EPS) / torch.clamp(1 - p, min=EPS))


def sine(v: Tensor, n: int, temperature: float = 10000.0) -> Tensor:
    """``(...)`` -> ``(..., n)``: feature i is sin (even i) / cos (odd i) of
    ``v / temperature ** (2 * (i // 2) / n)``."""
    feats = []
    for i in range(n):
        arg = v / temperature ** (2 * (i // 2) / n)
        feats.append(torch.sin(arg) if i % 2 == 0 else torch.cos(arg))
    return torch.stack(feats, dim=-1)


def attend(q: Tensor, k: Tensor, v: Tensor, heads: int, blocked: Tensor) -> Tensor:
    """Per head: softmax(q_h k_h^T / sqrt(dq)) v_h with ``blocked`` (B, Lq, Lk) logits at
    -inf; q, k ``(B, L, heads * dq)``, v ``(B, Lk, heads * dv)``."""
    dq, dv = q.shape[-1] // heads, v.shape[-1] // heads
    outs = []
    for h in range(heads):
        qh, kh = q[..., h * dq:(h + 1) * dq], k[..., h * dq:(h + 1) * dq]
        vh = v[..., h * dv:(h + 1) * dv]
        logits = qh @ kh.transpose(1, 2) / math.sqrt(dq)
        logits = logits.masked_fill(blocked, float("-inf"))
        logits = logits - logits.max(-1, keepdim=True).values
        weights = torch.exp(logits)
        weights = weights / weights.sum(-1, keepdim=True)
        outs.append(weights @ vh)
    return torch.cat(outs, dim=-1)


def encoder(w: dict, x: Tensor, pos: Tensor, pad: Tensor, heads: int, layers: int) -> Tensor:
    """DAB-DETR encoder: per layer pos * query_scale(x) added to queries and keys."""
    blocked = pad[:, None, :].expand(-1, x.shape[1], -1)
    c = x.shape[-1]
    for i in range(layers):
        p = f"transformer.encoder.layers.{i}"
        qk = x + pos * mlp(w, "transformer.encoder.query_scale", x, 2)
        win, bin_ = w[f"{p}.self_attn.in_proj_weight"], w[f"{p}.self_attn.in_proj_bias"]
        q = qk @ win[:c].T + bin_[:c]
        k = qk @ win[c:2 * c].T + bin_[c:2 * c]
        v = x @ win[2 * c:].T + bin_[2 * c:]
        x = layer_norm(w, f"{p}.norm1", x + linear(w, f"{p}.self_attn.out_proj",
                                                   attend(q, k, v, heads, blocked)))
        ffn = linear(w, f"{p}.linear2", prelu(w, f"{p}.activation", linear(w, f"{p}.linear1", x)))
        x = layer_norm(w, f"{p}.norm2", x + ffn)
    return x


def decoder(w, tgt, memory, pos, pad, anchors, self_blocked, heads, layers):
    """DAB-DETR decoder. Returns every layer's normed output and the box each layer
    started from (the refined boxes stay in the graph for the head; the next layer gets
    them detached)."""
    batch, nq, c = tgt.shape
    half = c // 2
    cross_blocked = pad[:, None, :].expand(-1, nq, -1)
    self_blocked = self_blocked[None].expand(batch, -1, -1)
    box = torch.sigmoid(anchors)
    starts, hs = [box], []
    x = tgt
    for i in range(layers):
        p = f"transformer.decoder.layers.{i}"
        cx, cy, bw, bh = (box[..., j] * 2 * math.pi for j in range(4))
        pe = torch.cat([sine(cy, half), sine(cx, half), sine(bw, half), sine(bh, half)], -1)
        query_pos = mlp(w, "transformer.decoder.ref_point_head", pe, 2)
        spatial = pe[..., :c]
        if i > 0:
            spatial = spatial * mlp(w, "transformer.decoder.query_scale", x, 2)
        ref_wh = torch.sigmoid(mlp(w, "transformer.decoder.ref_anchor_head", x, 2))
        spatial = torch.cat([spatial[..., :half] * (ref_wh[..., 1:2] / box[..., 3:4]),
                             spatial[..., half:] * (ref_wh[..., 0:1] / box[..., 2:3])], -1)
        # self-attention: content + position, separate projections
        q = linear(w, f"{p}.sa_qcontent_proj", x) + linear(w, f"{p}.sa_qpos_proj", query_pos)
        k = linear(w, f"{p}.sa_kcontent_proj", x) + linear(w, f"{p}.sa_kpos_proj", query_pos)
        v = linear(w, f"{p}.sa_v_proj", x)
        x = layer_norm(w, f"{p}.norm1", x + linear(w, f"{p}.self_attn.out_proj",
                                                   attend(q, k, v, heads, self_blocked)))
        # conditional cross-attention: per head [content, spatial] . [content, position]
        qc = linear(w, f"{p}.ca_qcontent_proj", x)
        kc = linear(w, f"{p}.ca_kcontent_proj", memory)
        kp = linear(w, f"{p}.ca_kpos_proj", pos)
        if i == 0:
            qc = qc + linear(w, f"{p}.ca_qpos_proj", query_pos)
            kc = kc + kp
        qs = linear(w, f"{p}.ca_qpos_sine_proj", spatial)
        d = c // heads
        q = torch.cat([torch.cat([qc[..., h * d:(h + 1) * d], qs[..., h * d:(h + 1) * d]], -1)
                       for h in range(heads)], -1)
        k = torch.cat([torch.cat([kc[..., h * d:(h + 1) * d], kp[..., h * d:(h + 1) * d]], -1)
                       for h in range(heads)], -1)
        v = linear(w, f"{p}.ca_v_proj", memory)
        x = layer_norm(w, f"{p}.norm2", x + linear(w, f"{p}.cross_attn.out_proj",
                                                   attend(q, k, v, heads, cross_blocked)))
        ffn = linear(w, f"{p}.linear2", prelu(w, f"{p}.activation", linear(w, f"{p}.linear1", x)))
        x = layer_norm(w, f"{p}.norm3", x + ffn)
        hs.append(layer_norm(w, "transformer.decoder.norm", x))
        refined = torch.sigmoid(mlp(w, "bbox_embed", x, 3) + logit(box))
        if i < layers - 1:
            starts.append(refined)
        box = refined.detach()
    return hs, starts


def dn_queries(w, targets, groups, label_noise, box_noise, noise, num_queries):
    """DN-DETR's denoising queries with the given draws: content, anchors (before the
    sigmoid) and the (P + Q, P + Q) blocked mask, built with loops."""
    c = w["label_enc.weight"].shape[1] + 1
    pad = max(len(t["labels"]) for t in targets)
    total = groups * pad
    contents, anchors = [], []
    for b, t in enumerate(targets):
        rows_c, rows_a = [], []
        for g in range(groups):
            for k in range(pad):
                if k >= len(t["labels"]):
                    rows_c.append(torch.zeros(c, dtype=w["label_enc.weight"].dtype))
                    rows_a.append(torch.zeros(4, dtype=w["label_enc.weight"].dtype))
                    continue
                label = int(t["labels"][k])
                if float(noise.label_draw[b, g, k]) < label_noise:
                    label = int(noise.random_label[b, g, k])
                cx, cy, bw, bh = (float(v) for v in t["boxes"][k])
                spread = (bw / 2, bh / 2, bw, bh)
                box = [min(max(v + (2 * float(noise.box_draw[b, g, k, j]) - 1) * spread[j]
                               * box_noise, 0.0), 1.0)
                       for j, v in enumerate((cx, cy, bw, bh))]
                rows_c.append(torch.cat([w["label_enc.weight"][label],
                                         torch.ones(1, dtype=w["label_enc.weight"].dtype)]))
                rows_a.append(logit(torch.tensor(box, dtype=w["label_enc.weight"].dtype)))
        contents.append(torch.stack(rows_c) if rows_c else torch.zeros(0, c))
        anchors.append(torch.stack(rows_a) if rows_a else torch.zeros(0, 4))
    blocked = torch.zeros(total + num_queries, total + num_queries, dtype=torch.bool)
    for i in range(total + num_queries):
        for j in range(total):  # only denoising keys are ever blocked
            if i >= total or i // pad != j // pad:
                blocked[i, j] = True
    return torch.stack(contents), torch.stack(anchors), blocked


def dab_detr(w, features, mask, pos, *, heads, enc_layers, dec_layers, num_classes,
             denoising=None, targets=None, noise=None):
    """The whole head on top of the backbone: ``features`` (B, Cin, H, W), ``mask``
    (B, H, W), ``pos`` (B, C, H, W). ``denoising``: (groups, label_noise, box_noise).

    Returns per decoder layer the logits and boxes of every query (denoising ones first),
    the boxes each layer started from, and P (the number of denoising queries)."""
    proj = torch.einsum("bihw,oi->bohw", features, w["input_proj.weight"][:, :, 0, 0])
    proj = proj + w["input_proj.bias"][None, :, None, None]
    batch, c = proj.shape[:2]
    src = proj.flatten(2).transpose(1, 2)
    pos = pos.flatten(2).transpose(1, 2)
    pad = mask.flatten(1)
    memory = encoder(w, src, pos, pad, heads, enc_layers)
    anchors = w["refpoint_embed.weight"][None].expand(batch, -1, -1)
    nq = anchors.shape[1]
    if "label_enc.weight" in w:
        row = torch.cat([w["label_enc.weight"][num_classes], torch.zeros(1, dtype=anchors.dtype)])
        tgt = row.expand(batch, nq, c)
    else:
        tgt = torch.zeros(batch, nq, c, dtype=anchors.dtype)
    blocked = torch.zeros(nq, nq, dtype=torch.bool)
    total = 0
    if denoising is not None:
        groups, label_noise, box_noise = denoising
        dn_c, dn_a, blocked = dn_queries(w, targets, groups, label_noise, box_noise, noise, nq)
        total = dn_c.shape[1]
        tgt = torch.cat([dn_c, tgt], 1)
        anchors = torch.cat([dn_a, anchors], 1)
    hs, starts = decoder(w, tgt, memory, pos, pad, anchors, blocked, heads, dec_layers)
    logits = [linear(w, "class_embed", h) for h in hs]
    boxes = [torch.sigmoid(mlp(w, "bbox_embed", h, 3) + logit(s)) for h, s in zip(hs, starts)]
    return logits, boxes, starts, total
