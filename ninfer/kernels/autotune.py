"""ninfer's ``triton.autotune``: Triton's autotuner plus the package's shipped choices and a registry.

Every autotuned kernel of ninfer is declared with :func:`ninfer_autotune` instead of ``triton.autotune``
(same arguments, plus a ``name`` when one function has several tuners). The :class:`ShippedAutotuner` it makes
is Triton's ``Autotuner`` with two additions:

* **shipped choices** (:mod:`ninfer.kernels.shipped`): when the package ships a config for this kernel and key
  on this GPU model and that config is one of the configs left after the kernel's own pruning (same kwargs,
  warps, stages, CTAs and register cap), the key takes it without benchmarking. This is an
  ``early_config_prune`` step, composed after the kernel's own (``dispatch.fp32_first_config``, ...), that
  prunes to the shipped config. ``Autotuner.run`` prunes only when a key is not in its cache, so a known key
  pays nothing. With one config left Triton 3.8 takes it untimed; Triton 3.6 still benchmarks it once, so
  ``_bench`` answers for the config the prune step just picked without launching (everything else goes to
  Triton's ``_bench``, which :mod:`compile_watch` wraps). The dry pass of :mod:`ninfer.kernels.precompile`
  requests every pruned config, so it compiles only the shipped one. A hit counts as an ``autotune-shipped``
  event (:mod:`compile_watch`), in the real pass (the dry pass chooses nothing);
* **a registry** (:func:`registered`), from which :mod:`ninfer.kernels.shipped_export` reads every tuner's
  choices (``Autotuner.cache``) to write a table.

The key is Triton's own (``Autotuner.run``): the values of the ``key`` arguments present in the call, then
``str(dtype)`` of every argument with a dtype, in the order the call binds them; the table stores it as
:func:`ninfer.kernels.shipped.autotune_key_text`. Kernels with a single config (the interpreter,
``NINFER_AUTOTUNE=off``) never consult anything, as Triton never builds their key.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from triton import Config
from triton.runtime.autotuner import Autotuner

from ninfer.kernels import compile_watch, shipped
from ninfer.kernels.precompile import dry_pass_active

Prune = Callable[..., list]
_registry: dict[str, ShippedAutotuner] = {}


def tuning_key(arg_names: list[str], keys: list[str], named_args: dict[str, Any], kwargs: dict[str, Any]) -> tuple:
    """The key ``Autotuner.run`` (Triton 3.6 and 3.8) files a call under: ``named_args`` are the positional
    arguments by name, ``kwargs`` the call's keywords (launch options and ``grid`` are not arguments: skipped)."""
    bound = {k: v for k, v in {**named_args, **kwargs}.items() if k in arg_names}
    key = [bound[k] for k in keys if k in bound]
    key.extend(str(v.dtype) for v in bound.values() if hasattr(v, "dtype"))
    return tuple(key)


def _device(bound: dict[str, Any]) -> torch.device | None:
    """The device of the call's first tensor argument (the launch's device), None without one."""
    return next((v.device for v in bound.values() if isinstance(v, torch.Tensor)), None)


def shipped_choice(kernel: str, key: tuple, configs: list[Config], named_args: dict[str, Any],
                   kwargs: dict[str, Any]) -> Config | None:
    """The config of ``configs`` that the shipped table holds for ``kernel`` and ``key`` on the call's GPU
    model, or None (switched off, no table or entry, or an entry that is not one of ``configs``)."""
    if not shipped.enabled():
        return None
    device = _device({**named_args, **kwargs})
    if device is None:
        return None
    fields = shipped.autotune_lookup(kernel, shipped.autotune_key_text(key), device)
    return None if fields is None else shipped.matching_config(fields, configs)


class ShippedAutotuner(Autotuner):
    """Triton's ``Autotuner`` that takes the shipped config of a key instead of benchmarking (module doc).

    ``ninfer_name`` is ``<module>.<name or function name>``, the kernel's name in the shipped table."""

    def __init__(self, fn: Any, configs: list[Config], key: list[str], *, name: str | None = None,
                 prune_configs_by: dict | None = None, **options: Any) -> None:
        prune = dict(prune_configs_by or {})
        self.ninfer_base_prune: Prune | None = prune.get("early_config_prune")
        self.ninfer_pick: Config | None = None  # the shipped config the last prune picked (for _bench)
        prune["early_config_prune"] = self._prune
        # The constructor's positional order is the same in Triton 3.6 and 3.8 (what triton.autotune passes).
        super().__init__(fn, fn.arg_names, configs, key, options.pop("reset_to_zero", None),
                         options.pop("restore_value", None), prune_configs_by=prune, **options)
        self.ninfer_name = f"{self.base_fn.__module__}.{name or self.base_fn.__name__}"

    def _prune(self, configs: list[Config], named_args: dict[str, Any], **kwargs: Any) -> list[Config]:
        """The kernel's own pruning, then only the shipped config if it survived it."""
        base = self.ninfer_base_prune
        pruned = base(configs, named_args, **kwargs) if base is not None else list(configs)
        key = tuning_key(self.arg_names, self.keys, named_args, kwargs)
        self.ninfer_pick = shipped_choice(self.ninfer_name, key, pruned, named_args, kwargs)
        if self.ninfer_pick is None:
            return pruned
        if not dry_pass_active():  # the dry pass only compiles: the real pass makes (and counts) the choice
            compile_watch.record_autotune_shipped(self.ninfer_name, key)
        return [self.ninfer_pick]

    def _bench(self, *args: Any, config: Config, **meta: Any) -> Any:
        # Triton 3.6 times even a lone pruned config: the shipped one needs no timing (Triton 3.8 never asks).
        if config is self.ninfer_pick:
            return [0.0, 0.0, 0.0]
        return super()._bench(*args, config=config, **meta)  # compile_watch's wrapper, looked up per call


def ninfer_autotune(configs: list[Config], key: list[str], *, name: str | None = None,
                    prune_configs_by: dict | None = None, **options: Any) -> Callable[[Any], ShippedAutotuner]:
    """``triton.autotune(configs, key, prune_configs_by=..., **options)`` for ninfer's kernels: a
    :class:`ShippedAutotuner`, registered as ``<module>.<name>`` (``name`` defaults to the function's; give one
    when a function has several tuners). ``configs`` come from ``dispatch.autotune_configs`` as before."""
    def decorator(fn: Any) -> ShippedAutotuner:
        tuner = ShippedAutotuner(fn, configs, key, name=name, prune_configs_by=prune_configs_by, **options)
        _registry[tuner.ninfer_name] = tuner  # a re-imported module replaces its tuners
        return tuner
    return decorator


def registered() -> dict[str, ShippedAutotuner]:
    """Every autotuned kernel declared so far, by its shipped-table name."""
    return dict(_registry)
