"""smp.DistributedOptimizer: a torch.optim optimizer over this rank's parameters, stepping only its replica's share
under sharded optimizer state."""

import collections
import functools
import io
import warnings

import torch

from ._clip import clip_model_grad_norm
from ._distributed_model import DistributedModel
from ._smp import CheckpointError
from ._state import runtime


def _owner_of(optimizer):
    """The DistributedModel whose parameters the optimizer holds (each of them points to it)."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            owner = getattr(parameter, "_smp_model", None)
            model = owner() if owner is not None else None
            if model is not None:
                return model
    raise ValueError("the optimizer holds no parameter of a DistributedModel of this process: build it over "
                     "model.parameters() (for a scripted module the engine trains a copy, so the original "
                     "module's parameters are not the ones it trains)")


def _in_saved_order(params, saved_names, by_name, index):
    """The parameters of group `index` in the order a checkpoint's optimizer held them (its state goes by position),
    found by name; the same set, else ValueError naming what moved (the caller's CheckpointError names the file)."""
    names = {id(tensor): name for name, tensor in by_name.items()}
    held = {names.get(id(p)) for p in params}
    moved = sorted(set(saved_names) ^ held, key=str)
    # Frozen parameters hold no state: an optimizer over model.parameters() resumes one over the trainable ones
    # alone (a LoRA job's), and the other way round; the saved order goes by name, the state with it.
    frozen = all(name in by_name and not by_name[name].requires_grad for name in moved)
    if moved and not (frozen and all(name in by_name for name in saved_names)):
        raise ValueError(f"parameter group {index} held other parameters when the checkpoint was saved (differing: "
                         f"{', '.join(map(str, moved[:4]))}{', ...' if len(moved) > 4 else ''})")
    return [by_name[name] for name in saved_names]


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch.optim optimizer over this rank's parameters, built over ``model.parameters()`` (parameter groups
    with options of their own are fine), that behaves as one: param_groups, state, state_dict, LR schedulers::

        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)

    ``step()`` steps it unless the engine dropped the step (an fp16 overflow, or a non-finite gradient under
    "nonfinite": "skip"); ``clip_grad_norm`` clips to the whole model's gradient norm, over all stages. With
    "shard_optimizer_state" in the config, the optimizer is left holding only the parameters this replica updates
    (so its state is a 1/replicas share), and ``step()`` then exchanges the updated parameters with the other
    replicas.
    """

    def __init__(self, optimizer, model=None, **smp_v1_options):
        from ._distributed_model import _SMP_V1_OPTIMIZER_OPTIONS, _refuse_smp_v1_options
        _refuse_smp_v1_options("DistributedOptimizer", smp_v1_options, _SMP_V1_OPTIMIZER_OPTIONS)
        if isinstance(optimizer, DistributedModel):
            raise TypeError("DistributedOptimizer takes a torch.optim optimizer: "
                            "smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=...))")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer built over model.parameters(), got "
                            f"{type(optimizer).__name__}")
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer holds the groups, state and hooks.
        self.optimizer = optimizer
        self._said_share = False
        self._model = model if model is not None else _owner_of(optimizer)
        named = self._model._model.named_parameters()
        ours = {id(p) for p in named.values()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        foreign = sum(1 for p in held if id(p) not in ours)
        if foreign:
            raise ValueError(f"the optimizer holds {foreign} tensor(s) that are not this rank's DistributedModel "
                             "parameters: build it over model.parameters()")
        held_ids = {id(p) for p in held}
        missing = [name for name, p in named.items() if p.requires_grad and id(p) not in held_ids]
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"the optimizer leaves out {len(missing)} trainable parameter(s) of this rank ({shown}): "
                             "build it over model.parameters(), or set requires_grad=False on what stays frozen")
        engine = self._model._model
        self._built_groups = [list(group["params"]) for group in optimizer.param_groups]
        if engine.optimizer_state_shards > 1:
            # "shard_optimizer_state": this replica's optimizer keeps only the parameters it updates (the others'
            # updates arrive after each step), so it never makes state for the rest.
            if len(optimizer.state) > 0:
                raise ValueError("with \"shard_optimizer_state\" the optimizer must not have stepped yet (it already "
                                 "holds state for every parameter): wrap it right after building it")
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ValueError("torch.optim.LBFGS cannot have its state sharded (it keeps its own list of all the "
                                 "parameters and needs a closure): leave \"shard_optimizer_state\" off")
            for group in optimizer.param_groups:  # groups keep their places, possibly empty, for checkpoints
                kept = [engine.updates_parameter(p) for p in group["params"]]
                for key in ("params", "param_names"):  # names (torch.optim over named_parameters()) stay aligned
                    if key in group:
                        group[key] = [item for item, keep in zip(group[key], kept) if keep]
            # The inner optimizer is handed out (LR schedulers take it, and loops call it directly): its own step
            # must still share the updates, and its zero_grad clear the gradients it no longer holds.
            optimizer.register_step_post_hook(lambda *_: engine.share_updated_parameters())
            optimizer.zero_grad = lambda set_to_none=True: engine.zero_grad(set_to_none)
            self._shard = {"replica": runtime().dp_rank, "replicas": engine.optimizer_state_shards}
        else:
            self._shard = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def add_param_group(self, param_group):
        raise ValueError("groups added after DistributedOptimizer wrapped the optimizer are not in its checkpoints or "
                         "its sharding: build the optimizer with all its groups first")

    def __repr__(self):
        return f"DistributedOptimizer({self.optimizer!r})"

    # Hooks go on the wrapped optimizer, whose step and state_dict this one's call.
    def register_step_pre_hook(self, hook):
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook, prepend=False):
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook, prepend=False):
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend=False):
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend=False):
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def zero_grad(self, set_to_none=True):
        """Clears the gradients of all of this rank's parameters (with sharded optimizer state, also those this
        replica's optimizer does not hold)."""
        self._model._model.zero_grad(set_to_none)

    def step(self, closure=None):
        """Steps the optimizer, unless the engine dropped a train_step whose gradients .grad holds (an fp16
        overflow, a skipped non-finite step, since zero_grad or the last step): even zero gradients would move the
        weights through momentum, and the train_steps accumulated after a dropped one hold part of the gradient
        (GradScaler skips such a step too). Returns what the wrapped optimizer's step returns (the closure's loss),
        None when the step was not taken (the `skipped` flag of train_step's results says why)."""
        runtime()._refuse_after_leaving("optimizer.step")
        engine = self._model._model
        dropped = engine.gradients_dropped
        engine.forget_dropped_gradients()
        if dropped:
            return None
        # A rank whose update failed holds other weights than its replicas (and, with sharded state, leaves them
        # waiting for its shares): it leaves the job.
        return runtime()._with_peers("the optimizer's step", lambda: self.optimizer.step(closure))

    def clip_grad_norm(self, max_norm):
        """Scales the gradients so that their 2-norm over the whole model is at most max_norm; returns the norm
        before clipping. Every rank calls it."""
        return clip_model_grad_norm(self._model, max_norm)

    def state_dict(self):
        """The optimizer's state_dict: of this rank's parameters (its stages'); with sharded state, this replica's
        share of those, marked with the replica it belongs to."""
        rt = runtime()
        partial = rt.world_size > rt.data_parallel_degree or rt.expert_parallel_degree > 1
        if not self._said_share and (partial or self._shard is not None):
            self._said_share = True  # said once, on each rank that calls it, as model.state_dict()'s share is
            held = "this rank's parameters" if partial else "this replica's share of the parameters"
            if partial and self._shard is not None:
                held += " (this replica's share of them)"
            warnings.warn(f"rank {rt.rank}: optimizer.state_dict() holds the state of {held} only; "
                          "smp.Checkpointer saves every rank's (local_state_dict() says the same without this "
                          "warning; said once)", stacklevel=2)
        return self.local_state_dict()

    def local_state_dict(self):
        """This rank's optimizer state, as state_dict() gives it (SMP's name for it)."""
        state = self.optimizer.state_dict()
        if self._shard is not None:
            state["smp_optimizer_shard"] = dict(self._shard)
        return state

    def load_state_dict(self, state):
        """Loads a state_dict of state_dict(); a sharded one only into the replica that saved it (the shapes of
        another replica's share may well fit, and silently train on the wrong moments)."""
        saved = state.get("smp_optimizer_shard")
        if saved != self._shard:
            def describe(shard):
                return (f"replica {shard['replica']}'s share of state sharded over {shard['replicas']} replicas"
                        if shard else "unsharded state")
            raise ValueError(f"this optimizer state_dict holds {describe(saved)}, but this optimizer takes "
                             f"{describe(self._shard)}")
        state = {key: value for key, value in state.items() if key != "smp_optimizer_shard"}
        self.optimizer.load_state_dict(state)

    def _load_shares(self, first_share, shares_to_read, read, on_first=None, scheduled=False):
        """Loads optimizer state saved as shares, whatever this optimizer's sharding: a checkpoint resumes into
        another number of replicas, or with sharding switched on or off. read(share) gives (path, state_dict, names
        of the parameters the saving replica's optimizer held); on_first(state_dict) sees the first one read.
        Options the checkpoint replaces are said, but for those an LR scheduler moves (`scheduled`)."""
        # load_state_dict matches saved state to the groups' parameters by position: each share loads while the
        # groups hold exactly the parameters of the replica that saved it; the groups then get this replica's back,
        # and the state of those another replica now updates goes at once.
        inner = self.optimizer
        if len(inner.param_groups) != len(self._built_groups):
            raise CheckpointError(f"the optimizer has {len(inner.param_groups)} parameter groups but had "
                                  f"{len(self._built_groups)} when DistributedOptimizer wrapped it (groups added later "
                                  "are not in its checkpoints)")
        by_name = self._model._model.named_parameters()
        held = [{key: group[key] for key in ("params", "param_names") if key in group} for group in inner.param_groups]
        kept = {id(p) for group in held for p in group["params"]}
        merged = {}

        def restore_groups():
            for group, saved in zip(inner.param_groups, held):
                group.pop("param_names", None)
                group.update(saved)

        options_before = [_options(group, scheduled) for group in inner.param_groups]
        for share in range(first_share, first_share + shares_to_read):
            path, state, names = read(share)
            state = torch.load(io.BytesIO(state), map_location="cpu", weights_only=True)
            if on_first is not None and share == first_share:
                on_first(state)
            saved_class = state.get("optimizer_class", type(inner).__name__)
            if saved_class != type(inner).__name__:
                raise CheckpointError(f"{path}: its optimizer state was saved by {saved_class}, and this optimizer is "
                                      f"{type(inner).__name__}: resume with the optimizer that saved it, or load the "
                                      "parameters alone (smp.export_checkpoint, then load_parameters)")
            saved_with = {id(by_name[name]) for name in names if name in by_name}
            try:
                for index, (group, built) in enumerate(zip(inner.param_groups, self._built_groups)):
                    group["params"] = [p for p in built if id(p) in saved_with]
                    group.pop("param_names", None)  # torch.optim checks them against the saved ones otherwise
                    if "parameter_names" in state:  # by name, in the saving optimizer's order
                        group["params"] = _in_saved_order(group["params"], state["parameter_names"][index], by_name,
                                                          index)
                inner.load_state_dict(state["optimizer"])
            except Exception as error:
                restore_groups()
                inner.state = collections.defaultdict(dict)  # no half-loaded state
                raise CheckpointError(f"{path}: optimizer state does not fit this optimizer: {error}") from error
            merged.update({p: s for p, s in inner.state.items() if id(p) in kept})
            restore_groups()
        inner.state = collections.defaultdict(dict, merged)
        changed = sorted({f"{key} {value!r} -> {group.get(key)!r}"
                          for before, group in zip(options_before, inner.param_groups)
                          for key, value in before.items() if repr(group.get(key)) != repr(value)})
        if changed and runtime().rank == 0:
            warnings.warn(f"resume: the checkpoint's optimizer options replaced this optimizer's ({'; '.join(changed)}), "
                          "as torch.optim's load_state_dict does: to train on with others, set them in "
                          "optimizer.param_groups after resume()" +
                          ("; under the LR scheduler, whose next step sets lr from its own base, its base_lrs too "
                           "(scheduler.base_lrs = [...])" if scheduled else ""), stacklevel=3)


def _options(group, scheduled):
    """The parameter group's options a resume should keep as the program built them: under an LR scheduler only the
    base learning rate (initial_lr, where the scheduler sets one: the schedulers move lr, and OneCycleLR momentum and
    betas too), else every option."""
    if scheduled:
        return {"initial_lr": group["initial_lr"]} if "initial_lr" in group else {}
    return {key: value for key, value in group.items() if key not in ("params", "param_names")}


def refuse_grad_scaler():
    """torch.amp.GradScaler's step and unscale_ over a DistributedOptimizer (a DDP loop's habit) say what smp does
    instead: its assertion that scale() was never called named the wrong cause. Subclasses that override them
    (FSDP's ShardedGradScaler overrides unscale_), now or imported later, are refused alike."""
    scalers = [torch.amp.GradScaler]
    while scalers:
        scaler = scalers.pop()
        _refuse_over_distributed_optimizer(scaler)
        scalers.extend(scaler.__subclasses__())
    if "__init_subclass__" not in torch.amp.GradScaler.__dict__:
        def refusing_in_subclasses(cls, **kwargs):
            super(torch.amp.GradScaler, cls).__init_subclass__(**kwargs)
            _refuse_over_distributed_optimizer(cls)
        torch.amp.GradScaler.__init_subclass__ = classmethod(refusing_in_subclasses)


def _refuse_over_distributed_optimizer(scaler):
    for name in ("step", "unscale_"):
        original = scaler.__dict__.get(name)
        if original is None or getattr(original, "_smp_original", None) is not None:
            continue

        @functools.wraps(original)
        def refusing(self, optimizer, *args, _original=original, _name=name, **kwargs):
            if isinstance(optimizer, DistributedOptimizer) and self.is_enabled():
                raise RuntimeError(f"{type(self).__name__}.{_name} over an smp.DistributedOptimizer: train_step runs "
                                   "the backward, so the scaler never scaled a loss. With \"fp16\": true smp scales "
                                   "the loss and unscales the gradients itself, and drops a step whose gradients "
                                   "overflowed (optimizer.step() then does nothing); \"bf16\" needs no scaling. "
                                   "Call optimizer.step() without a GradScaler")
            return _original(self, optimizer, *args, **kwargs)
        refusing._smp_original = original
        setattr(scaler, name, refusing)
