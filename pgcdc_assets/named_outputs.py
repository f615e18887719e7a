"""Assets and checks of one op under names pgcdc gives its outputs and inputs, so asset keys keep the tables' real names.

``@multi_asset`` and ``@multi_asset_check`` name each output and input after its asset key
(``AssetKey.to_python_identifier``: the parts joined with ``__``, only ``-`` and ``.`` replaced), and
Dagster's names must match ``^[A-Za-z0-9_]+$``. So a table named ``"Order Items"`` failed the load
of the whole code location, and ``order-items`` met ``order_items`` (a ``KeyError``). Asset keys
themselves may hold any string. Here each op is an ordinary ``@op`` whose outputs and inputs are
named by ``resources.names.dagster_name`` from the role and the key's parts (injective, the same
at every load), and ``AssetsDefinition`` binds them to the specs as the translator made them.
The decorators' behaviour is kept: optional ``Nothing`` outputs (a subsettable op yields only what
it materialized), an input for each upstream asset outside the op (so a run that selects both
steps runs them in order), checks' outputs untyped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dagster import (
    AssetCheckKey,
    AssetChecksDefinition,
    AssetCheckSpec,
    AssetKey,
    AssetsDefinition,
    AssetSpec,
    In,
    Nothing,
    OpDefinition,
    Out,
)

from resources.names import dagster_name


def output_name(key: AssetKey) -> str:
    """The op output that materializes ``key``."""
    return dagster_name("asset", *key.path)


def check_output_name(key: AssetCheckKey) -> str:
    """The op output that evaluates the check ``key``."""
    return dagster_name("check", key.name, *key.asset_key.path)


def input_name(key: AssetKey) -> str:
    """The op input that waits for the upstream asset ``key``."""
    return dagster_name("upstream", *key.path)


@dataclass(frozen=True, slots=True)
class NamedOutputs:
    """What one op materializes (``specs``) and checks (``check_specs``), and the op's inputs and
    outputs for them: the same names for the ``@op`` and for its ``AssetsDefinition``."""

    specs: Sequence[AssetSpec] = ()
    check_specs: Sequence[AssetCheckSpec] = ()

    @property
    def upstream(self) -> list[AssetKey]:
        """Assets the op depends on but does not produce: the specs' deps and the checked assets, in order."""
        own = {spec.key for spec in self.specs}
        wanted = [dep.asset_key for spec in self.specs for dep in spec.deps]
        wanted += [check.asset_key for check in self.check_specs]
        return [key for key in dict.fromkeys(wanted) if key not in own]

    @property
    def ins(self) -> dict[str, In]:
        return {input_name(key): In(Nothing) for key in self.upstream}

    @property
    def outs(self) -> dict[str, Out]:
        assets = {output_name(spec.key): Out(Nothing, is_required=False) for spec in self.specs}
        checks = {check_output_name(check.key): Out(is_required=False) for check in self.check_specs}
        return {**assets, **checks}

    def assets_definition(self, op_def: OpDefinition) -> AssetsDefinition:
        """The op as the assets of ``specs`` (with ``check_specs``), subsettable per asset and check."""
        return AssetsDefinition(
            node_def=op_def,
            keys_by_input_name={input_name(key): key for key in self.upstream},
            keys_by_output_name={output_name(spec.key): spec.key for spec in self.specs},
            check_specs_by_output_name={check_output_name(check.key): check for check in self.check_specs},
            specs=list(self.specs),
            can_subset=True,
        )

    def checks_definition(self, op_def: OpDefinition) -> AssetChecksDefinition:
        """The op as the checks of ``check_specs`` only (no asset of its own), subsettable per check."""
        assert not self.specs, "an op with assets is an assets_definition"
        return AssetChecksDefinition.create(
            keys_by_input_name={input_name(key): key for key in self.upstream},
            node_def=op_def,
            check_specs_by_output_name={check_output_name(check.key): check for check in self.check_specs},
            can_subset=True,
        )
