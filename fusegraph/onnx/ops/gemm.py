"""Matrix products: MatMul and Gemm. Constant B operands are "matrix" tensors, laid out
for the engine (``importer.MATRIX_COLUMN_MAJOR``); Gemm folds alpha and beta into them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fusegraph.onnx.ops.common import reshape
from fusegraph.onnx.ops.table import Unmappable, lowers

if TYPE_CHECKING:
    from fusegraph.onnx.importer import Importer
    from fusegraph.onnx.model import ONode


@lowers("MatMul")
def lower_matmul(imp: Importer, node: ONode) -> None:
    a_s, b_s = imp.shape(node.inputs[0]), imp.shape(node.inputs[1])
    a = imp.tensor(node.inputs[0], "plain")
    b = imp.tensor(node.inputs[1], "matrix" if len(b_s) == 2 and imp.is_const(node.inputs[1]) else "plain")
    if len(a_s) == 1:
        a = reshape(imp, a, (1, a_s[0]))
    if len(b_s) == 1:
        b = reshape(imp, b, (b_s[0], 1))
    y = imp.g.matmul(a, b)
    out = imp.og.shape(node.outputs[0])
    if out is not None and (len(a_s) == 1 or len(b_s) == 1):
        y = reshape(imp, y, out) if out else y
    imp.set(node.outputs[0], y)


@lowers("Gemm")
def lower_gemm(imp: Importer, node: ONode) -> None:
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    ta, tb = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    for n in node.inputs[:2]:
        if len(imp.shape(n)) != 2:
            raise Unmappable(f"Gemm: input '{n}' is not 2-D {list(imp.shape(n))}")
    if imp.is_const(node.inputs[0]) and ta:
        a = imp.constant(np.ascontiguousarray(imp.og.constants[node.inputs[0]].T), node.inputs[0], "plain")
    else:
        a = imp.tensor(node.inputs[0], "plain")
        if ta:
            a = imp.g.transpose(a, [1, 0])
    folded_alpha = False
    if imp.is_const(node.inputs[1]):
        bw = imp.og.constants[node.inputs[1]]
        bw = bw.T if tb else bw
        if alpha != 1.0 and bw.dtype.kind == "f":
            bw = bw * np.asarray(alpha, dtype=bw.dtype)
            folded_alpha = True
        b = imp.constant(np.ascontiguousarray(bw), node.inputs[1], "matrix")
    else:
        b = imp.tensor(node.inputs[1], "plain")
        if tb:
            b = imp.g.transpose(b, [1, 0])
    y = imp.g.matmul(a, b)
    if alpha != 1.0 and not folded_alpha:
        y = imp.g.mul(y, imp.scalar(alpha, y.dtype))
    if len(node.inputs) > 2 and node.inputs[2] and beta != 0.0:
        cname = node.inputs[2]
        if imp.is_const(cname):
            c = imp.og.constants[cname]
            if beta != 1.0:
                c = c * np.asarray(beta, dtype=c.dtype)
            ct = imp.g.scalar(c.reshape(-1)[0].item(), y.dtype) if c.size == 1 else imp.constant(c, cname, "plain")
        else:
            ct = imp.tensor(cname, "plain")
            if beta != 1.0:
                ct = imp.g.mul(ct, imp.scalar(beta, ct.dtype))
        y = imp.g.add(y, ct)
    imp.set(node.outputs[0], y)
