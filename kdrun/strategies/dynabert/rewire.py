"""Phase 1 of DynaBERT (Hou et al., 2020): network rewiring.

Importance of every attention head and FFN neuron is measured with masks, as Michel et al. (2019)
do for heads: a mask of ones multiplies each head's context vector (the input of the attention
output projection, head by head) and each FFN neuron's activation (the input of the FFN output
projection). The importance of a unit is the first-order estimate of the loss change when it is
removed, ``|dL/d mask|``, summed over batches: ``I = sum_batches |sum_{x in batch} dL(x)/d mask|``.
L is the task loss with the gold labels (cross-entropy; MSE for regression), as in DynaBERT.

Rewiring reorders the units of each layer by decreasing importance *in the weights*: Q, K and V
rows and the output projection's columns head by head, the FFN's input rows (and bias) and output
columns neuron by neuron. Permuting units that are summed over changes nothing the layer computes
(up to floating-point summation order), so the rewired model computes the same function; afterwards
"the first k heads" are the k most important ones, which a width multiplier keeps.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kdrun.models.features import model_inputs
from kdrun.strategies.dynabert.subnet import check_model, layer_list, shape_of


def importance(model: nn.Module, batches: Iterable[dict[str, Any]], regression: bool = False,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(L, H) head importance and (L, F) FFN-neuron importance of ``model`` on ``batches`` (module doc).

    The model runs in eval mode (no dropout); its weights and gradients are left untouched."""
    check_model(model, "rewiring")
    shape = shape_of(model)
    layers = layer_list(model)
    head_mask = torch.ones(shape.layers, shape.heads, device=device, requires_grad=True)
    ffn_mask = torch.ones(shape.layers, shape.ffn, device=device, requires_grad=True)
    head_imp = torch.zeros(shape.layers, shape.heads, device=device)
    ffn_imp = torch.zeros(shape.layers, shape.ffn, device=device)
    handles = []
    for i, layer in enumerate(layers):
        def heads_hook(_m, args, i=i):
            return (args[0] * head_mask[i].repeat_interleave(shape.head_dim).to(args[0].dtype),) + args[1:]

        def ffn_hook(_m, args, i=i):
            return (args[0] * ffn_mask[i].to(args[0].dtype),) + args[1:]

        handles.append(layer.attention.output.dense.register_forward_pre_hook(heads_hook))
        handles.append(layer.output.dense.register_forward_pre_hook(ffn_hook))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            logits = model(**model_inputs(batch, model)).logits.float()
            labels = batch["labels"]
            loss = (F.mse_loss(logits.view(-1), labels.float().view(-1)) if regression
                    else F.cross_entropy(logits, labels.long()))
            g_head, g_ffn = torch.autograd.grad(loss, [head_mask, ffn_mask])
            head_imp += g_head.abs()
            ffn_imp += g_ffn.abs()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return head_imp.detach(), ffn_imp.detach()


def _take_rows(lin: nn.Linear, idx: torch.Tensor) -> None:
    lin.weight.copy_(lin.weight[idx])
    if lin.bias is not None:
        lin.bias.copy_(lin.bias[idx])


@torch.no_grad()
def rewire(model: nn.Module, head_imp: torch.Tensor, ffn_imp: torch.Tensor) -> dict[str, list[list[int]]]:
    """Reorder every layer's heads and FFN neurons by decreasing importance, in place (module doc).

    Parameters keep their identity (values are copied), so an optimizer built before still holds them.
    Returns the new order of each layer: ``{"heads": [[old index, ...] per layer], "ffn": [...]}``."""
    check_model(model, "rewiring")
    shape = shape_of(model)
    orders: dict[str, list[list[int]]] = {"heads": [], "ffn": []}
    for i, layer in enumerate(layer_list(model)):
        dev = layer.attention.self.query.weight.device
        order = torch.argsort(head_imp[i].to(dev), descending=True, stable=True)
        rows = (order[:, None] * shape.head_dim + torch.arange(shape.head_dim, device=dev)).reshape(-1)
        a = layer.attention
        for lin in (a.self.query, a.self.key, a.self.value):
            _take_rows(lin, rows)
        a.output.dense.weight.copy_(a.output.dense.weight[:, rows])
        f_order = torch.argsort(ffn_imp[i].to(dev), descending=True, stable=True)
        _take_rows(layer.intermediate.dense, f_order)
        layer.output.dense.weight.copy_(layer.output.dense.weight[:, f_order])
        orders["heads"].append(order.tolist())
        orders["ffn"].append(f_order.tolist())
    return orders
