"""FactoredMatrix: a low-rank product ``A @ B`` handled without materializing it unless asked."""

from __future__ import annotations

from functools import cached_property

import torch
from jaxtyping import Complex, Float
from torch import Tensor


class FactoredMatrix:
    """``A [..., ldim, mdim] @ B [..., mdim, rdim]`` with leading batch dims broadcast.

    Operations that need only the factors (``@``, ``T``, ``svd``, ``eigenvalues``, ``norm``,
    indexing over leading dims, ``get_corner``) never build the ``ldim x rdim`` product; ``AB``
    does.
    """

    def __init__(
        self, A: Float[Tensor, "... ldim a_inner"], B: Float[Tensor, "... b_inner rdim"]
    ) -> None:
        if A.ndim < 2 or B.ndim < 2:
            raise ValueError(
                f"A and B need at least 2 dims, got {list(A.shape)} and {list(B.shape)}"
            )
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(
                f"inner dimensions differ: A is {list(A.shape)} and B is {list(B.shape)}; "
                "A's last dim must equal B's second-to-last"
            )
        batch = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        self.A = A.expand(*batch, *A.shape[-2:])
        self.B = B.expand(*batch, *B.shape[-2:])
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.A.shape[:-2], self.ldim, self.rdim))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={list(self.shape)}, inner dim={self.mdim})"

    @property
    def AB(self) -> Float[Tensor, "... ldim rdim"]:
        """The full product (materialized)."""
        return self.A @ self.B

    @property
    def BA(self) -> Float[Tensor, "... mdim mdim"]:
        """``B @ A`` (square, inner dim), which shares the nonzero eigenvalues of ``AB``."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square product; this one is {self.ldim} x {self.rdim}")
        return self.B @ self.A

    @property
    def T(self) -> FactoredMatrix:
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def __matmul__(self, other: Tensor | FactoredMatrix) -> FactoredMatrix | Tensor:
        if isinstance(other, FactoredMatrix):
            return FactoredMatrix(self.A, (self.B @ other.A) @ other.B)
        if not isinstance(other, Tensor):
            return NotImplemented
        if other.ndim == 1:
            return (self.A @ (self.B @ other[:, None]))[..., 0]
        if other.shape[-2] != self.rdim:
            raise ValueError(f"cannot multiply {list(self.shape)} by {list(other.shape)}")
        if other.shape[-1] < self.mdim:
            return self.A @ (self.B @ other)
        return FactoredMatrix(self.A, self.B @ other)

    def __rmatmul__(self, other: Tensor) -> FactoredMatrix | Tensor:
        if not isinstance(other, Tensor):
            return NotImplemented
        if other.ndim == 1:
            return ((other[None, :] @ self.A) @ self.B)[..., 0, :]
        if other.shape[-1] != self.ldim:
            raise ValueError(f"cannot multiply {list(other.shape)} by {list(self.shape)}")
        if other.shape[-2] < self.mdim:
            return (other @ self.A) @ self.B
        return FactoredMatrix(other @ self.A, self.B)

    def __mul__(self, scalar: float | int | Tensor) -> FactoredMatrix:
        if isinstance(scalar, Tensor) and scalar.numel() != 1:
            raise ValueError("a FactoredMatrix can only be multiplied elementwise by a scalar")
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    def __getitem__(self, index: int | slice | tuple) -> FactoredMatrix:
        """Index the leading (batch) dims, then rows and columns; an integer row or column index
        keeps that dim with size 1, so the result stays a factored matrix."""
        index = index if isinstance(index, tuple) else (index,)
        batch = self.ndim - 2
        if len(index) <= batch:
            return FactoredMatrix(self.A[index], self.B[index])
        if len(index) > self.ndim:
            raise IndexError(f"too many indices for a FactoredMatrix of shape {list(self.shape)}")
        lead, rest = index[:batch], index[batch:]
        left, right = self.A[lead], self.B[lead]
        left = left[..., _keep_dim(rest[0], self.ldim), :]
        if len(rest) > 1:
            right = right[..., _keep_dim(rest[1], self.rdim)]
        return FactoredMatrix(left, right)

    @cached_property
    def _svd(self) -> tuple[Tensor, Tensor, Tensor]:
        # A = Ua Sa Vha; B = Ub Sb Vhb: AB = Ua (Sa Vha Ub Sb) Vhb, an mdim x mdim core.
        ua, sa, vha = torch.linalg.svd(self.A, full_matrices=False)
        ub, sb, vhb = torch.linalg.svd(self.B, full_matrices=False)
        core = (sa[..., :, None] * (vha @ ub)) * sb[..., None, :]
        uc, s, vhc = torch.linalg.svd(core, full_matrices=False)
        return ua @ uc, s, (vhc @ vhb).transpose(-2, -1)

    def svd(
        self,
    ) -> tuple[Float[Tensor, "... ldim k"], Float[Tensor, "... k"], Float[Tensor, "... rdim k"]]:
        """``(U, S, V)`` with ``AB = U diag(S) V^T`` (k = min(ldim, mdim, rdim)), S descending."""
        return self._svd

    @property
    def U(self) -> Float[Tensor, "... ldim k"]:
        return self._svd[0]

    @property
    def S(self) -> Float[Tensor, "... k"]:
        return self._svd[1]

    @property
    def Vh(self) -> Float[Tensor, "... k rdim"]:
        return self._svd[2].transpose(-2, -1)

    @property
    def eigenvalues(self) -> Complex[Tensor, "... mdim"]:
        """Eigenvalues of the (square) product, from the small ``BA`` (same nonzero spectrum)."""
        return torch.linalg.eigvals(self.BA)

    def norm(self) -> Float[Tensor, "..."]:
        """Frobenius norm of the product (from its singular values)."""
        return self.S.pow(2).sum(-1).sqrt()

    def get_corner(self, k: int = 3) -> Float[Tensor, "... k1 k2"]:
        """The top-left ``k x k`` block of the product."""
        return self.A[..., :k, :] @ self.B[..., :, :k]

    def collapse_l(self) -> Float[Tensor, "... mdim rdim"]:
        """``S V^T``: the product with the left orthonormal factor removed."""
        return self.S[..., :, None] * self.Vh

    def collapse_r(self) -> Float[Tensor, "... ldim mdim"]:
        """``U S``: the product with the right orthonormal factor removed."""
        return self.U * self.S[..., None, :]

    def unsqueeze(self, dim: int) -> FactoredMatrix:
        """Add a leading batch dim (``dim`` counts among the batch dims, negative from the end)."""
        dim = dim if dim >= 0 else self.ndim + 1 + dim
        if dim > self.ndim - 2:
            raise ValueError("unsqueeze only adds batch dims (before the last two)")
        return FactoredMatrix(self.A.unsqueeze(dim), self.B.unsqueeze(dim))


def _keep_dim(index: int | slice | Tensor | list, size: int) -> slice | Tensor | list:
    if isinstance(index, int):
        if not -size <= index < size:
            raise IndexError(f"index {index} is out of range for a dim of size {size}")
        index %= size
        return slice(index, index + 1)
    return index
