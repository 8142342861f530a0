"""Type stubs of the native module (see `kruskal/__init__.py` for the
public functions' documentation)."""

from os import PathLike
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

__version__: str

class GpuError(RuntimeError):
    """The GPU could not be used or failed."""

class SparseTensor:
    """A sparse tensor in coordinate form (indices uint32 per mode, values
    float32); repeated coordinates are summed."""

    def __init__(self, indices: npt.ArrayLike, values: npt.ArrayLike,
                 shape: Sequence[int]) -> None: ...
    @staticmethod
    def from_pyttb(x: Any) -> SparseTensor: ...
    @staticmethod
    def from_sparse(x: Any) -> SparseTensor: ...
    @staticmethod
    def from_scipy(x: Any) -> SparseTensor: ...
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def nnz(self) -> int: ...
    @property
    def indices(self) -> npt.NDArray[np.int64]: ...
    @property
    def values(self) -> npt.NDArray[np.float32]: ...
    def norm(self) -> float: ...

def read(path: Union[str, PathLike], *, zero_based: bool = False, pattern: bool = False,
         values_are_data: bool = False, dims: Optional[Sequence[int]] = None) -> SparseTensor: ...

def cp_als(tensor: SparseTensor, rank: int, *, backend: str, gpus: int, pick_gpus: bool, iters: int,
           tol: float, init: Optional[List[npt.NDArray[np.float32]]], seed: int, starts: int,
           kernel: str,
           callback: Optional[Callable[[int, int, float, float], bool]],
           nonneg_all: bool = ..., nonneg_modes: Optional[List[int]] = ...,
           l1: Optional[float] = ..., l2: Optional[float] = ...) -> dict: ...

def mttkrp(tensor: SparseTensor, factors: List[npt.NDArray[np.float32]], mode: int, *,
           backend: str, kernel: str) -> npt.NDArray[np.float32]: ...

def devices() -> Tuple[List[dict], Optional[str]]: ...

def cp_apr(tensor: SparseTensor, rank: int, *, iters: int, inner_iters: int, tol: float,
           kappa: float, kappa_tol: float, eps_div_zero: float, time_limit: Optional[float],
           init: Optional[List[npt.NDArray[np.float64]]], weights: Optional[List[float]],
           seed: int, callback: Optional[Callable[[int, float, float], bool]],
           backend: str, gpus: int = 1, pick_gpus: bool = False) -> dict: ...
