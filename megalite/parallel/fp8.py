"""FP8 matmuls for the transformer blocks' column- and row-parallel linears (`fp8.recipe`).

Each of a linear's three products — forward y = x W^T, input gradient dx = dy W, weight
gradient dW = dy^T x — runs as `torch._scaled_mm` on float8 operands with fp32 accumulation
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning": e4m3 for weights and activations,
e5m2's wider range for gradients). An operand is scaled so its largest magnitude lands on the
format's largest finite value (dynamic "current" scaling, as torchao's float8 training):

    tensorwise  one scale per tensor; gradients (dy) in e5m2
    rowwise     one scale per row along the product's contraction dimension (a token's row
                of x, an output feature's row of W, ...); gradients in e4m3, as torchao's
                rowwise recipe (cuBLAS's row-wise scaled kernels take e4m3 operands only)

Scales follow the layout, so a parallel run quantizes every element exactly as the serial run
does: a tensorwise scale is one number for the global tensor, so the amax of a tensor split
over TP (every weight; the row-parallel input; the column-parallel output gradient) is
max-reduced over the TP group; a rowwise scale spans the contraction dimension, so it is
reduced where TP splits that dimension (the row-parallel forward, the column-parallel input
gradient). The token dimension (the weight gradient's contraction) is never split over TP: with
sequence parallelism the input is gathered first, as the bf16 layer does. Context parallelism
splits the tokens over CP: a tensorwise amax of a token tensor (x, dy) is max-reduced over the
CP group too (`Fp8Linear.token_group`), so its scale is the serial run's (the rowwise recipe is
refused with cp > 1: its weight-gradient rows would span the CP ranks' tokens). Under ZeRO-3 the
linear sees its gathered weight: the cast to FP8 comes after the gather (the gather itself
stays in the parameters' dtype).

The function saves its high-precision input and weight (as the bf16 linear does; under
ZeRO-3 the weight is a view of the regathered storage) and casts them again in backward along
the backward products' contraction dimensions: the FP8 copies live only for one product.
Tensorwise, a tensor's scale does not depend on the product it enters (one amax over all its
elements), so the forward keeps x's and W's amaxes (two fp32 scalars) for the backward and dy's
serves both backward products: each amax is taken, and reduced over TP, once per micro-batch
— the same scales, so the same FP8 bits, as taking them again.
The weight gradient leaves the product in the parameters' dtype and is accumulated as before
(ZeRO's fp32 main gradients). Embeddings, the LM head, the loss, the norms and Llama's q/k/v projections
(`megalite.model.llama.Projection`) never come here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.group import Group
from megalite.parallel.weight_grad import WeightGradQueue, defer_or_run

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12  # an all-zero operand (row) gets a finite scale


@dataclass(frozen=True)
class Fp8Linear:
    """How one linear's products run in FP8: the recipe, the TP group and the split
    (`column`: W split by output features, the input replicated or gathered; else row-parallel:
    W and the input split by input features), and whether the layer gathers a sequence-
    parallel input itself (`gather`)."""

    recipe: str
    group: Group
    column: bool
    gather: bool = False
    token_group: Optional[Group] = None  # CP: the ranks holding the sequences' other tokens

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def grad_dtype(self) -> torch.dtype:
        return E4M3 if self.rowwise else E5M2

    def amax_group(self, tensor_split: bool, contraction_split: bool) -> Optional[Group]:
        """The group an operand's amax is reduced over: a tensorwise scale covers the whole
        tensor, a rowwise one the whole contraction dimension."""
        split = contraction_split if self.rowwise else tensor_split
        return self.group if split and self.group.size > 1 else None


def amax_of(t: torch.Tensor, rowwise: bool, group: Optional[Group]) -> torch.Tensor:
    """The fp32 amax of t [R, C] (a scalar, or [R, 1] with `rowwise`), max-reduced over
    `group`."""
    amax = (t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().amax()).float()
    if group is not None:
        comm.all_reduce(amax, group, op=dist.ReduceOp.MAX)
    return amax


def quantize(t: torch.Tensor, dtype: torch.dtype, rowwise: bool, group: Optional[Group],
             amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (t in `dtype`, the fp32 inverse scale: a scalar, or [R, 1] with `rowwise`).
    The scale maps the amax (`amax_of`, unless given), onto the format's largest finite
    value; the product is computed in fp32 before the cast (one fp32 staging copy of t at a
    time, 4 bytes an element, besides the 1-byte result)."""
    t = t.contiguous()
    amax = amax_of(t, rowwise, group) if amax is None else amax
    top = torch.finfo(dtype).max
    scale = top / amax.clamp(min=AMAX_FLOOR)
    staged = t.to(torch.float32, copy=True).mul_(scale).clamp_(-top, top)  # one fp32 copy
    return staged.to(dtype), scale.reciprocal()


Amaxes = Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


def scaled_product(a: torch.Tensor, b: torch.Tensor, dtypes: Tuple[torch.dtype, torch.dtype],
                   layer: Fp8Linear, groups: Tuple[Optional[Group], Optional[Group]],
                   out_dtype: torch.dtype, amaxes: Amaxes = (None, None)) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T in FP8 (both scaled along K), fp32 accumulation, in `out_dtype`
    (`amaxes`: the operands' amaxes where known). cuBLAS's row-wise kernels write bf16 only:
    there the result is cast afterwards."""
    a8, scale_a = quantize(a, dtypes[0], layer.rowwise, groups[0], amaxes[0])
    b8, scale_b = quantize(b, dtypes[1], layer.rowwise, groups[1], amaxes[1])
    if layer.rowwise:
        scale_b = scale_b.t().contiguous()
    mm_dtype = torch.bfloat16 if layer.rowwise and a.is_cuda else out_dtype
    if a.is_cuda:
        out = torch._scaled_mm(a8, b8.t(), scale_a, scale_b, out_dtype=mm_dtype)
    else:
        with emulated_cpu_kernel():
            out = torch._scaled_mm(a8, b8.t(), scale_a, scale_b, out_dtype=mm_dtype)
    return out.to(out_dtype)


@contextlib.contextmanager
def emulated_cpu_kernel():
    """On a CPU, `torch._scaled_mm`'s emulated kernel (dequantize, fp32 matmul) whatever the
    CPU: on one with AMX, PyTorch sends a product of two operands of one FP8 format through
    oneDNN instead (mkldnn enabled), whose sums and short-lived buffers differ — the CPU's
    FP8 (fp8.emulate, a test feature) would then depend on the machine: a CP run's FP8
    products round differently from the serial run's beyond fp32's 1e-5, and the plan's CPU
    term (`megalite.plan.fp8_terms.product_bytes`) counts the emulated kernel's buffers."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def tensor_amaxes(layer: Fp8Linear, tensors, groups, tokens) -> Amaxes:
    """Tensorwise: each tensor's amax over `groups` (kept for the products it enters again),
    and over `layer.token_group` where `tokens` says the tensor holds this rank's tokens;
    rowwise: none (a row's scale depends on the product's contraction)."""
    if layer.rowwise:
        return None, None
    amaxes = tuple(amax_of(t, False, g) for t, g in zip(tensors, groups))
    cp = layer.token_group
    if cp is not None and cp.size > 1:
        for amax, token in zip(amaxes, tokens):
            if token:
                comm.all_reduce(amax, cp, op=dist.ReduceOp.MAX)
    return amaxes


def _weight_grads(layer: Fp8Linear, grad: torch.Tensor, x: torch.Tensor,
                  dtype: torch.dtype, has_bias: bool, amaxes: Amaxes
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """dW = dy^T x (contraction over tokens, never split over TP: a sequence shard x is
    gathered first) and db = sum dy, in the parameters' `dtype`; `amaxes`: dy's and x's
    (tensorwise), or none."""
    total = comm.gather_seq(x, layer.group) if layer.gather else x
    g2 = grad.reshape(-1, grad.shape[-1])
    x2 = total.reshape(-1, total.shape[-1])
    grad_w = scaled_product(
        g2.t(), x2.t(), (layer.grad_dtype, E4M3), layer,
        (layer.amax_group(layer.column, False), layer.amax_group(not layer.column, False)),
        dtype, amaxes)
    return grad_w, g2.sum(0).to(dtype) if has_bias else None


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with the three products in FP8 (`Fp8Linear`); with `layer.gather` x is a
    sequence shard, gathered in forward and again in backward (only the shard is kept), and
    dx is reduce-scattered. With `queue` (zero-bubble schedules, `megalite.parallel.
    weight_grad`) the parameters come in detached and dW, db are deferred to the W."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer: Fp8Linear, params=None, queue=None):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.params, ctx.queue = layer, params, queue
        ctx.has_bias = bias is not None
        total = comm.gather_seq(x, layer.group) if layer.gather else x
        row = not layer.column  # the row-parallel input and contraction are split over TP
        x2 = total.reshape(-1, total.shape[-1])
        groups = (layer.amax_group(row, row), layer.amax_group(True, row))
        ctx.amaxes = tensor_amaxes(layer, (x2, weight), groups, (True, False))  # x's, W's
        y = scaled_product(x2, weight, (E4M3, E4M3), layer, groups, x.dtype, ctx.amaxes)
        y = y.view(*total.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        column = layer.column  # the column-parallel dy and dx's contraction are split over TP
        g2 = grad.reshape(-1, grad.shape[-1])
        groups = (layer.amax_group(column, column), layer.amax_group(True, column))
        x_amax, w_amax = ctx.amaxes
        dy_amax = tensor_amaxes(layer, (g2,), groups[:1], (True,))[0]
        grad_x = scaled_product(g2, weight.t(), (layer.grad_dtype, E4M3), layer, groups,
                                x.dtype, (dy_amax, w_amax))
        grad_x = grad_x.view(*grad.shape[:-1], weight.shape[1])
        if layer.gather:
            grad_x = comm.reduce_scatter_seq(grad_x, layer.group)
        if ctx.queue is not None:
            w, b = ctx.params

            def weight_grads():  # keeps the shard x, gathered again at the W
                grad_w, grad_b = _weight_grads(layer, grad, x, w.dtype, b is not None,
                                               (dy_amax, x_amax))
                return [(w, grad_w)] + ([] if b is None else [(b, grad_b)])

            defer_or_run(ctx.queue, weight_grads)
            return grad_x, None, None, None, None, None
        grad_w, grad_b = _weight_grads(layer, grad, x, weight.dtype, ctx.has_bias,
                                       (dy_amax, x_amax))
        return grad_x, grad_w, grad_b, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               layer: Fp8Linear, queue: Optional[WeightGradQueue] = None) -> torch.Tensor:
    """The product of a column- or row-parallel layer in FP8 (the layer's communication
    regions around it stay where they are; with `layer.gather` the sequence gather is here)."""
    if queue is None:
        return _Fp8LinearFunction.apply(x, weight, bias, layer)
    return _Fp8LinearFunction.apply(x, weight.detach(), None if bias is None else bias.detach(),
                                    layer, (weight, bias), queue)


def use_fp8(model: torch.nn.Module, recipe: str, token_group: Optional[Group] = None) -> int:
    """Switch every linear of `model` that can run in FP8 (those with an `fp8` attribute: the
    column- and row-parallel linears of the blocks; not the LM head, whose weight is the
    embedding) to `recipe` ("none": back to the parameters' dtype); `token_group`: the CP
    group their token tensors' amaxes are reduced over too. Returns how many."""
    linears = [m for m in model.modules() if hasattr(m, "fp8")]
    for module in linears:
        module.fp8 = None if recipe == "none" else recipe
        module.fp8_token_group = token_group
    return len(linears)
