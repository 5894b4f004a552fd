"""Every rollout kind is declared against the `Rollout` protocol and implements all of it."""

import inspect
import pkgutil

import pytest

import offpolicy_jax.rollout as rollout_wing
from offpolicy_jax.rollout import episode_pool, episodes, partial, sampler_mesh, whole
from offpolicy_jax.rollout.protocol import Rollout

KINDS = [
  whole.Whole,
  partial.Partial,
  episodes.WholeEpisodes,
  episode_pool.EpisodePool,
  sampler_mesh.OnSamplerMesh,
]
MEMBERS = ("traced", "prefetch", "item", "init", "advance")
MEMBERS += ("signature", "arrays", "meta", "restore", "with_sampler")


def _classes_with_advance():
  """Every class defined in the rollout wing that has an `advance` method."""
  for info in pkgutil.iter_modules(rollout_wing.__path__):
    module = __import__(f"offpolicy_jax.rollout.{info.name}", fromlist=["_"])
    for _, cls in inspect.getmembers(module, inspect.isclass):
      if cls.__module__ == module.__name__ and cls is not Rollout and hasattr(cls, "advance"):
        yield cls


def test_the_kinds_are_every_class_of_the_wing_that_advances():
  assert set(_classes_with_advance()) == set(KINDS)


def _stubs(kind) -> list[str]:
  """The protocol members `kind` only inherits from `Rollout` (its `...` stubs)."""
  return [n for n in MEMBERS if next(c for c in kind.__mro__ if n in vars(c)) is Rollout]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_kind_is_declared_against_the_protocol_and_implements_every_member(kind):
  assert Rollout in kind.__mro__, f"{kind.__name__} is not declared as a Rollout"
  assert _stubs(kind) == []
  want = inspect.signature(Rollout.advance).parameters
  got = inspect.signature(kind.advance).parameters
  assert list(got) == list(want), f"{kind.__name__}.advance{list(got)}"
  assert [p.default for p in got.values()] == [p.default for p in want.values()]


def test_a_kind_that_forgets_members_is_caught():
  class Forgetful(Rollout):
    traced = prefetch = False
    item = ""

    def advance(self, rstate, params, version, prompts, step, key, latest=None):
      raise AssertionError

  assert _stubs(Forgetful) == ["init", "signature", "arrays", "meta", "restore", "with_sampler"]


def test_only_whole_responses_switch_sampler_and_the_others_say_why():
  """The sampler choice's switch (`sampler_choice.continuous_fns`) goes through the protocol."""
  static, continuous = object(), object()
  w = whole.Whole(static)
  switched = w.with_sampler(continuous)
  assert switched.sampler is continuous and w.sampler is static
  placed = sampler_mesh.OnSamplerMesh(w, None, None, None)
  assert placed.with_sampler(continuous).inner.sampler is continuous
  for kind, field in (
    (partial.Partial, "rollout.partial_budget"),
    (episodes.WholeEpisodes, "multiturn.max_turns"),
    (episode_pool.EpisodePool, "rollout.episode_pool"),
  ):
    # The method reads nothing of the instance: called on the class's own, unbuilt.
    with pytest.raises(ValueError, match=f"{field}.*no switch to continuous batching"):
      kind.with_sampler(None, continuous)
