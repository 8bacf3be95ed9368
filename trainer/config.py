"""The trainer's typed config: defaults in one place, `key=value` overrides, unknown keys rejected.

    python -m trainer --config run.json data=out/train eval_data=out/test model=cnn strategy=mirrored steps=500
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing

from dataset_format import booleans, storage
from dataset_format.suggest import did_you_mean, near_path

STRATEGIES = ("default", "one_device", "mirrored", "central_storage", "fsdp", "multi_worker", "tpu", "parameter_server")
MODES = ("train", "evaluate")
OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor")
DECAYED = ("all", "matrices")  # weight_decay_on
SCHEDULES = ("constant", "cosine", "linear")
DTYPES = ("float32", "bfloat16")
SIZE_KEYS = ("width", "depth", "heads", "mlp_ratio")  # the keys that size the models in SIZED_MODELS
SIZED_MODELS = ("transformer_lm",)
ATTENTIONS = ("auto", "cudnn", "splash", "blockwise", "dense")  # trainer/attention.py
# what the backward pass recomputes of each LM block (trainer/models.py remat_policy): none, ours (elementwise: the
# norms and activations), MaxText's remat_policy names; the config's auto picks among them (trainer/remat.py)
REMATS = ("none", "elementwise", "full", "minimal", "minimal_with_context", "save_qkv_proj", "save_out_proj",
          "save_dot_except_mlp", "save_dot_except_mlpwi", "save_dot_with_context_except_mlp")
REMAT_CHOICES = ("auto", *REMATS)
# transformer_lm's layout (MaxText's names): GPT-2's by default; Llama's: num_kv_heads < heads, rope, rmsnorm, SwiGLU
LAYOUT_KEYS = ("num_kv_heads", "head_dim", "mlp_dim", "mlp_activations", "normalization",
               "normalization_layer_epsilon", "position_embedding", "rope_max_timescale", "logits_via_embedding",
               "normalize_embedding_logits")
NORMALIZATIONS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned", "rope")
MLP_ACTIVATIONS = ("gelu", "silu", "swish", "relu", "linear")  # one, or two whose outputs multiply (gated)
# MaxText's names for what the trainer calls otherwise: named when a config uses them
MAXTEXT_NAMES = {"emb_dim": "width", "base_emb_dim": "width", "num_decoder_layers": "depth",
                 "base_num_decoder_layers": "depth", "num_query_heads": "heads", "base_num_query_heads": "heads",
                 "base_num_kv_heads": "num_kv_heads", "base_mlp_dim": "mlp_dim", "max_target_length": "seq_len",
                 "per_device_batch_size": "batch_size (the global batch)", "remat_policy": "remat",
                 "per_device_batch_size_start": "batch_size_start (the global batch)",
                 "per_device_batch_size_increment": "batch_size_increment (of the global batch)",
                 "global_rampup_samples": "rampup_samples",
                 "eval_interval": "eval_every", "checkpoint_period": "checkpoint_every", "log_period": "log_every",
                 "eval_per_device_batch_size": "batch_size (evaluation reads batches of the training's global size)",
                 "adam_weight_decay": "weight_decay (with optimizer=adamw)", "gradient_clipping_threshold": "grad_clip",
                 "dataset_path": "data",
                 "base_output_directory": "workdir (the run's own directory: MaxText's base_output_directory/run_name)",
                 "warmup_steps_fraction": "warmup_steps (a count of steps)",
                 "gradient_accumulation_steps": "grad_accum_steps", "train_split": "split",
                 "cosine_learning_rate_final_fraction": "end_lr_fraction (with schedule=cosine)"}
# MaxText's settings with no key of the same meaning here: what covers them, for the unknown-key error
MAXTEXT_ELSEWHERE = {
    "opt_type": "optimizer= (adamw, adam, sgd, adafactor)",
    "weight_dtype": "the parameters are float32 here; dtype= sets the step's compute dtype",
    "mu_dtype": "Adam's moments are float32 here",
    "dataset_type": "the source's kind comes from data= (a converted or TFDS directory, or a glob of shards)",
    "grain_train_files": "data= (a converted directory, or a glob of its shards)",
    "grain_eval_files": "eval_data=",
    "grain_worker_count": "data_workers=",
    "ici_fsdp_parallelism": "strategy=fsdp shards over every device",
    "ici_data_parallelism": "strategy=mirrored replicates over every device",
    "dcn_data_parallelism": "strategy= spans every host's devices",
    "tokenizer_path": "tokenizer= (or convert --tokenizer, whose manifest names it)",
    "enable_rampup_batch_size": "a batch-size ramp-up is on when batch_size_start= is set",
    "run_name": "workdir= is the run's own directory (MaxText's base_output_directory/run_name): a workdir holding a "
                "checkpoint resumes it",
    "enable_checkpointing": "checkpoints are always written (checkpoint_every= steps apart, and at the last step)",
}
# MaxText's attention= names -> ours
MAXTEXT_ATTENTIONS = {"dot_product": "dense", "flash": "auto (cuDNN on a GPU, Splash on a TPU, else blockwise)",
                      "cudnn_flash_te": "cudnn", "autoselected": "auto"}
LM_KEYS = SIZE_KEYS + LAYOUT_KEYS + ("attention", "remat", "use_iota_embed",
                                     "logits_dot_in_fp32")  # what model=transformer_lm takes


# Settings that one part of the trainer reads, and when it does: (names, whether this run reads them, what they are
# for, what this run has instead, the fix). Given otherwise than their defaults where they are not read, they would
# be ignored without a word (a run's end_lr_fraction under a constant schedule), so they are refused.
_READ_WHEN = (
    (("end_lr_fraction", "learning_rate_schedule_steps"), lambda c: c.schedule != "constant",
     "a decaying schedule (schedule=cosine or linear)", lambda c: "schedule=constant", "pass schedule=cosine"),
    (("momentum",), lambda c: c.optimizer == "sgd", "optimizer=sgd", lambda c: f"optimizer={c.optimizer}",
     "pass optimizer=sgd"),
    (("text_key", "seq_len", "vocab_size", "tokenizer"), lambda c: c.task != "classification", "task=lm",
     lambda c: "task=classification", "pass task=lm"),
    (("num_classes", "image_key", "image_size", "label_key", "label_offset", "max_pixels"), lambda c: c.task != "lm",
     "task=classification", lambda c: "task=lm", "pass task=classification"),
    (("num_workers", "num_ps", "ps_min_shard_bytes", "ray_address"), lambda c: c.strategy == "parameter_server",
     "strategy=parameter_server", lambda c: f"strategy={c.strategy}", "pass strategy=parameter_server"),
    (("join_timeout",), lambda c: c.strategy in ("multi_worker", "parameter_server"),
     "strategy=multi_worker or parameter_server", lambda c: f"strategy={c.strategy}", "pass strategy=multi_worker"),
    (("eval_steps",), lambda c: c.eval_data is not None, "evaluating eval_data=",
     lambda c: "no eval_data", "add eval_data=PATH"),
    (("profile_skip",), lambda c: c.profile_steps > 0, "a device profile (profile_steps=N)", lambda c: "none",
     "add profile_steps=N"),
)


def setting_text(value) -> str:
    """A setting's value as the command line writes it (true/false for bools), for logs and errors."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _default(name: str):
    """TrainConfig's default for field `name`."""
    return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: str  # anything loader.load takes, or a mixture NAME=PATH,NAME=PATH (a {name: path} in a config file)
    workdir: str  # where checkpoints and metrics go
    eval_data: str | None = None  # a path, or NAME=PATH,...: then eval_<name>_loss per component too
    weights: str | None = None  # a mixture's weights NAME=W,NAME=W (a {name: weight} in a config file)
    task: str = "classification"  # a built-in task, or package.module:attr: your own (trainer/tasks.py)
    # a built-in model, or package.module:attr naming a flax.linen.Module; None: the task's (lm: transformer_lm, else cnn)
    model: str | None = None
    mode: str = "train"  # or evaluate: the sidecar evaluator (trainer/evaluator.py; also TF_CONFIG type "evaluator")
    strategy: str = "default"  # how the step is distributed over devices and hosts (docs/training.md)
    device: str | None = None  # for one_device, e.g. "cpu:0" or "gpu:1"
    # multi_worker: explicit cluster (else TF_CONFIG, else JAX's auto-detection on TPU VMs, Slurm, GKE, ...)
    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None  # multi_worker: processes in the job
    process_id: int | None = None  # multi_worker: this process's index, 0 .. num_processes - 1
    # multi_worker: seconds each process waits for the job's others to join (JAX's default); parameter_server with
    # ray_address: seconds it waits for the cluster's nodes to offer the "worker"/"ps" units its actors need
    join_timeout: float = 300.0
    # parameter_server (trainer/parameter_server.py): Ray actors on this machine, or on a Ray cluster
    num_workers: int = 2
    num_ps: int = 1  # parameter_server: ps tasks holding the variables
    ps_min_shard_bytes: int = 256 << 10  # a variable is split across ps tasks in shards of at least this size
    ray_address: str | None = None  # join this Ray cluster (else TF_CONFIG's chief, else a local one)
    # evaluate: stop after evaluating step `steps`, or after this many seconds without a new checkpoint
    eval_timeout: float = 3600.0
    steps: int = 1000  # optimizer updates to run (evaluate: the last step to wait for)
    batch_size: int = 128  # global
    learning_rate: float = 1e-3  # the peak, after warmup
    # The optimizer (trainer/optim.py) and the step's precision and accumulation, as MaxText/big_vision users expect.
    optimizer: str = "adam"  # adam, adamw, sgd, adafactor
    schedule: str = "constant"  # constant, cosine, linear: decay to learning_rate * end_lr_fraction at `steps`
    warmup_steps: int = 0  # linear warmup from 0
    end_lr_fraction: float = 0.0  # cosine/linear: the learning rate at `steps`, as a fraction of the peak
    # the steps the schedule spans (MaxText's name; default: steps), the rate held at its end after them: set it to a
    # run's steps to raise steps= on resuming without moving its learning rates
    learning_rate_schedule_steps: int | None = None
    # adam, adamw (MaxText's names): the decay rate of the gradient's first moment
    adam_b1: float = 0.9
    adam_b2: float = 0.999  # the second moment's decay rate (LLM pretraining commonly takes 0.95, MaxText's default)
    adam_eps: float = 1e-8  # added to the second moment's root in the update's denominator
    weight_decay: float = 0.0  # adamw: decoupled; sgd: added to the gradient; adafactor: its decay rate
    # What weight_decay decays: all (every parameter, as optax and MaxText do), or matrices (parameters of two or more
    # dimensions: kernels and embeddings, not biases or norm scales, as nanoGPT, Hugging Face and big_vision do)
    weight_decay_on: str = "all"
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd: Nesterov's momentum (Flax's ImageNet example trains ResNet-50 with it)
    grad_clip: float = 0.0  # clip gradients to this global norm (0: off)
    grad_accum_steps: int = 1  # split each batch into this many micro-batches, one update (less device memory)
    # Batch-size ramp-up (trainer/rampup.py; MaxText's enable_rampup_batch_size): the global batch grows from
    # batch_size_start by batch_size_increment to batch_size over the first rampup_samples examples
    batch_size_start: int = 0  # the ramp-up's first global batch size (0: no ramp-up)
    batch_size_increment: int = 0  # the ramp-up's step from one batch size to the next
    rampup_samples: int = 0  # the examples the ramp-up spans, an equal share at each size below batch_size
    dtype: str = "float32"  # compute dtype: bfloat16 computes in bf16, parameters and optimizer state stay float32
    seed: int = 0  # parameters' initialisation, data order and augmentation
    num_classes: int | None = None  # classification: default the TFDS ClassLabel's; needed for other data
    image_key: str = "image"  # classification: the image feature
    # classification of encoded images (JPEG/PNG bytes, e.g. ImageNet-layout `image/encoded`, or a TFDS Image):
    # decode and Inception-crop + flip to image_size x image_size for training, resize + central crop for eval
    image_size: int | None = None
    label_key: str = "label"  # classification: the integer label feature
    label_offset: int = 0  # classification: added to each label before it is checked and trained on (1-based: -1)
    # classification: train on (1 - label_smoothing) x the one-hot label + label_smoothing / num_classes (Szegedy et
    # al.'s label smoothing; MLPerf's ResNet-50 takes 0.1); evaluation's loss and accuracy are against the labels
    label_smoothing: float = 0.0
    text_key: str = "text"  # lm: the token-sequence feature (int64 ids, or text read as UTF-8 bytes)
    seq_len: int = 256  # lm: tokens per row
    vocab_size: int | None = None  # lm over int64 ids (byte-level text: 258; with a tokenizer: its vocabulary)
    tokenizer: str | None = None  # lm: a SentencePiece .model or a Hugging Face tokenizer.json (or a directory holding one)
    # lm with tokenizer= (trainer/tokenizer.py): true: one BOS / EOS on each text (never doubled; an error if the
    # tokenizer has none), false: none; unset: as the tokenizer does (SentencePiece: BOS, no EOS; tokenizer.json:
    # what its post-processor adds)
    add_bos: bool | None = None
    add_eos: bool | None = None  # as add_bos, for one EOS at each text's end
    # model=transformer_lm's size (MaxText: emb_dim, num_decoder_layers, num_query_heads, mlp_dim = mlp_ratio * width)
    width: int = 128  # d_model: each token's features (a multiple of heads, unless head_dim is set)
    depth: int = 2  # Transformer blocks
    heads: int = 4  # attention (query) heads, each width / heads features wide (or head_dim)
    mlp_ratio: int = 4  # each block's MLP has mlp_ratio * width hidden units (unless mlp_dim is set)
    # transformer_lm's layout, by MaxText's names; the defaults are GPT-2's, Llama's is num_kv_heads < heads
    # position_embedding=rope normalization=rmsnorm mlp_activations=silu,linear (docs/training.md)
    num_kv_heads: int | None = None  # key/value heads, dividing heads: grouped-query attention (1: multi-query)
    head_dim: int | None = None  # features of each head (default width / heads)
    mlp_dim: int | None = None  # the MLP's hidden units (default mlp_ratio * width)
    # the MLP's activation, or two comma-separated (gelu, silu or swish, relu, linear) whose outputs multiply:
    # silu,linear is SwiGLU (a list in a config file, as in MaxText's)
    mlp_activations: str = "gelu"
    normalization: str = "layernorm"  # or rmsnorm
    normalization_layer_epsilon: float = 1e-6  # the norms' epsilon (Llama: 1e-5)
    position_embedding: str = "learned"  # a table of seq_len positions, or rope: rotary embeddings of queries and keys
    rope_max_timescale: float = 10_000.0  # rope: the longest wavelength's scale (Llama 3: 500000)
    # the output layer: its own (false), or the token embedding's table transposed (true: tied embeddings, as GPT-2's),
    # then divided by sqrt(width) unless normalize_embedding_logits=false
    logits_via_embedding: bool = False
    normalize_embedding_logits: bool = True  # tied logits divided by sqrt(width), as MaxText does (false: GPT-2's)
    # the output layer's dot product in float32 whatever dtype is (MaxText's, for stability with large vocabularies;
    # the logits go to the loss in float32 either way)
    logits_dot_in_fp32: bool = False
    # transformer_lm's attention: auto (the fused kernel, cuDNN's on a GPU and Splash on a TPU, where it compiles and
    # matches blockwise on packed rows, else blockwise), cudnn, splash,
    # blockwise (flash attention in JAX: memory grows with seq_len, not its square) or dense ([B, H, S, S] scores)
    attention: str = "auto"
    # transformer_lm: what the backward pass recomputes of each block instead of keeping it: auto (on a GPU or TPU the
    # first of none, elementwise, full whose compiled step fits the devices' free memory; elsewhere elementwise:
    # trainer/remat.py), none (nothing), elementwise (the norms and activations), or MaxText's remat_policy names:
    # full, minimal, minimal_with_context, save_qkv_proj, save_out_proj, save_dot_except_mlp, save_dot_except_mlpwi,
    # save_dot_with_context_except_mlp
    remat: str = "auto"
    # transformer_lm: token and position embeddings as one-hot matrix multiplies (MaxText's use_iota_embed): the
    # backward pass is a matrix multiply instead of a scatter-add of every token's gradient into the tables. auto: for
    # tables of at most 4,096 rows on a GPU or TPU (trainer/models.py embed_by_matmul), true, false
    use_iota_embed: bool | str = "auto"
    packing: bool = False  # lm: pack examples into rows of seq_len, training and eval (loader/planning/packing.py)
    # The records of `data`: a TFDS split (default "train"), a slice of one in TFDS's syntax ("train[:99%]"), or a
    # slice alone, which for other sources is of all their records ("[:99%]", with eval_split="[99%:]": a held-out
    # part of one corpus)
    split: str | None = None
    eval_split: str | None = None  # the same for `eval_data` (default: "test" for TFDS sources)
    log_every: int = 50  # steps between log lines and metrics
    eval_every: int = 250  # steps between evaluations of eval_data
    # batches each evaluation reads, from the start of eval_data (MaxText's name; default: all of it). With
    # packing=true, evaluation packs eval_data as training packs data: every token scored
    eval_steps: int | None = None
    checkpoint_every: int = 250  # steps between checkpoints (also one at the end and at SIGTERM)
    # write each checkpoint in the background (MaxText's name and default): the loop waits only for the state to be
    # copied to host memory, and trains on while orbax writes it; false: wait for each checkpoint to be written
    async_checkpointing: bool = True
    # loader worker processes for `data` (0: threads in this process; auto: threads here, or as many worker processes
    # as the step's demand needs, measured as it runs). Default: auto on a host with an accelerator, 0 on CPU.
    data_workers: int | str | None = None
    data_ray_address: str | None = None  # run the data_workers as Ray actors on this Ray cluster (docs/ray-workers.md)
    data_ray_resource: str | None = None  # with data_ray_address: a custom resource (1 an actor) that places them
    data_cache_bytes: int = 0  # gs:// data: keep up to this many bytes of its chunks, in memory or in data_cache_dir
    data_cache_dir: str | None = None  # gs:// data: keep the cached chunks on this local disk (docs/staging.md)
    allow_incomplete: bool = False  # train on the shards that converted when a conversion's manifest lists failures
    check_hashes: bool = True  # check the shards' chunk hashes as records are read (a damaged byte is an error)
    max_record_bytes: int = 256 << 20  # a larger record is an error (the loader's; loader/fetch/reader.py)
    # an image declaring more pixels is an error before it decodes (a decompression bomb; loader/decoding/images.py)
    max_pixels: int = 178_956_970
    # 0: stream batches from the loader. N > 0: read N batches once, keep them on the devices and cycle
    # them: no input cost at all, the input-bound limit that benchmarks/trainer_bench.py compares against.
    in_memory_batches: int = 0
    # a device profile (trainer/profiling.py) of this many steps, after profile_skip steps of the run, into
    # WORKDIR/profile for TensorBoard's profile plugin or XProf (MaxText: profiler=xplane, profiler_steps)
    profile_steps: int = 0
    profile_skip: int = 10  # steps of this run before the profiled ones (the first compile and fill the buffers)
    # JAX's persistent compilation cache (trainer/compile_cache.py), so a restarted run does not compile its step
    # again: auto = WORKDIR/compilation_cache for a local workdir (none for gs://), none = off, or a directory
    compilation_cache: str = "auto"

    def _check_rampup(self) -> None:
        """The batch-size ramp-up's settings (trainer/rampup.py): each size a whole number of increments below
        batch_size, each split into grad_accum_steps micro-batches; one line naming the fix otherwise."""
        start, increment, samples = self.batch_size_start, self.batch_size_increment, self.rampup_samples
        if not start:
            given = [n for n in ("batch_size_increment", "rampup_samples") if getattr(self, n)]
            if given:
                raise ValueError(f"{given[0]}={getattr(self, given[0])} is for a batch-size ramp-up, which "
                                 "batch_size_start= turns on: set it (the first global batch size), or drop "
                                 f"{given[0]}=")
            return
        if not 0 < start < self.batch_size:
            raise ValueError(f"batch_size_start={start} must be between 0 and batch_size={self.batch_size} (the ramp "
                             "ends at batch_size)")
        if increment < 1 or (self.batch_size - start) % increment:
            raise ValueError(f"batch_size_increment={increment} must be >= 1 and divide batch_size - "
                             f"batch_size_start = {self.batch_size - start}")
        if samples < 1:
            raise ValueError(f"rampup_samples={samples}: a ramp-up needs the examples it spans (>= 1), e.g. "
                             f"rampup_samples={100 * self.batch_size}")
        bad = [size for size in range(start, self.batch_size, increment) if size % self.grad_accum_steps]
        if bad:
            raise ValueError(f"the ramp-up's batch size {bad[0]} does not split into grad_accum_steps="
                             f"{self.grad_accum_steps} micro-batches; choose batch_size_start and batch_size_increment "
                             f"as multiples of {self.grad_accum_steps}")
        for name, value, why in (("in_memory_batches", self.in_memory_batches, "cycles batches of one size"),
                                 ("strategy", self.strategy == "parameter_server", "workers take batches of one size")):
            if value:
                raise ValueError(f"batch_size_start= ramps the batch size up, and {name}={getattr(self, name)} "
                                 f"{why}: drop one of them")

    def _check_loader_options(self) -> None:
        """The loader's own rules (loader.LoaderConfig) on the values the trainer hands it, its errors in the
        trainer's names: one set of rules, checked where they live."""
        from loader import LoaderConfig

        try:
            LoaderConfig(batch_size=self.batch_size, worker_count=0 if self.data_workers is None else self.data_workers,
                         ray_address=self.data_ray_address, cache_bytes=self.data_cache_bytes,
                         cache_dir=self.data_cache_dir,
                         ray_resources={self.data_ray_resource: 1} if self.data_ray_resource else None)
        except ValueError as e:
            message = str(e).replace(", and resize them with the iterator's resize_workers(n)", "")  # (a loop's)
            raise ValueError(_LOADER_NAMES.sub(lambda m: _TRAINER_NAMES[m.group(0)], message)) from None

    @property
    def data_source(self) -> str | dict[str, str]:
        """`data` for loader.load: a path, or a mixture's {name: path}."""
        return mixture_of(self.data, "data")

    @property
    def eval_source(self) -> str | dict[str, str] | None:
        return None if self.eval_data is None else mixture_of(self.eval_data, "eval_data")

    @property
    def data_weights(self) -> dict[str, float] | None:
        if self.weights is None or isinstance(self.weights, dict):
            return self.weights
        weights = {}
        for name, value in _pairs(self.weights, "weights").items():
            try:
                weights[name] = float(value)
            except ValueError:
                raise ValueError(f"weights: {name}={value!r} is not a number; e.g. weights=web=0.7,code=0.3") from None
        return weights

    @property
    def model_size(self) -> dict[str, int | str]:
        """The size keys, attention and remat as model keyword arguments for the models they size ({} for any other
        model)."""
        return {name: getattr(self, name) for name in LM_KEYS} if self.model in SIZED_MODELS else {}

    @property
    def model_settings(self) -> str:
        """The model keys this run sets otherwise than their defaults, as KEY=VALUE, for the log ("" for none)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return " ".join(f"{k}={setting_text(v)}" for k, v in self.model_size.items() if v != defaults[k])

    @property
    def schedule_steps(self) -> int:
        """The steps the learning-rate schedule spans: learning_rate_schedule_steps, else steps."""
        return self.learning_rate_schedule_steps or self.steps

    @property
    def checkpoint_dir(self) -> str:
        """WORKDIR/checkpoints, absolute (as orbax wants it; a gs:// workdir as it is): the trainers write it, the
        evaluator reads it."""
        return storage.absolute(storage.join(self.workdir, "checkpoints"))

    def __post_init__(self):
        if self.model is None:
            object.__setattr__(self, "model", "transformer_lm" if self.task == "lm" else "cnn")
        self._check_numbers_and_paths()
        for name in ("steps", "learning_rate_schedule_steps", "batch_size", "log_every", "eval_every", "eval_steps",
                     "checkpoint_every", "num_classes", "seq_len", "vocab_size", "image_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {name}={getattr(self, name)})")
        for name in ("num_workers", "num_ps", "ps_min_shard_bytes", "max_record_bytes", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {name}={getattr(self, name)})")
        if self.eval_timeout <= 0:
            raise ValueError(f"eval_timeout must be > 0 seconds (got eval_timeout={self.eval_timeout})")
        for name in ("in_memory_batches", "profile_steps", "profile_skip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {name}={getattr(self, name)})")
        self._check_loader_options()
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0 (got learning_rate={self.learning_rate})")
        for name, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("dtype", DTYPES), ("mode", MODES),
                              ("weight_decay_on", DECAYED)):
            if getattr(self, name) not in allowed:
                ours = MAXTEXT_ATTENTIONS.get(self.attention) if name == "attention" else None
                also = f" (MaxText's attention={self.attention} is attention={ours} here)" if ours else ""
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}{also}")
        for name in ("warmup_steps", "weight_decay", "momentum", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {name}={getattr(self, name)})")
        if self.warmup_steps >= self.schedule_steps:
            spans = (f"learning_rate_schedule_steps={self.learning_rate_schedule_steps}"
                     if self.learning_rate_schedule_steps is not None else f"steps={self.steps}")
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below {spans}")
        if not 0 <= self.end_lr_fraction <= 1:
            raise ValueError(f"end_lr_fraction must be in [0, 1] (got end_lr_fraction={self.end_lr_fraction})")
        if self.optimizer == "adam" and self.weight_decay:
            raise ValueError("optimizer=adam has no weight decay; use optimizer=adamw with weight_decay=")
        for name in ("adam_b1", "adam_b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1) (got {name}={getattr(self, name)}); the default is "
                                 f"{_default(name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"adam_eps must be > 0 (got adam_eps={self.adam_eps}); the default is 1e-08")
        changed = [n for n in ("adam_b1", "adam_b2", "adam_eps") if getattr(self, n) != _default(n)]
        if changed and self.optimizer not in ("adam", "adamw"):
            raise ValueError(f"{changed[0]}={getattr(self, changed[0])} is for optimizer=adam or adamw, and this run's "
                             f"is {self.optimizer}: drop {changed[0]}= or pass optimizer=adamw")
        if self.nesterov and (self.optimizer != "sgd" or not self.momentum):
            raise ValueError(f"nesterov=true is sgd's Nesterov momentum, and this run has optimizer={self.optimizer}"
                             f"{'' if self.optimizer != 'sgd' else ' momentum=0'}: pass optimizer=sgd with momentum > 0,"
                             " or drop nesterov=")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1) (got label_smoothing={self.label_smoothing}); "
                             "0.1 is the usual value")
        if self.label_smoothing and self.task != "classification":
            raise ValueError(f"label_smoothing={self.label_smoothing} is for task=classification, and this run's is "
                             f"task={self.task}: drop label_smoothing=")
        if self.weight_decay_on != "all" and not self.weight_decay:
            raise ValueError(f"weight_decay_on={self.weight_decay_on} chooses what weight_decay decays, and "
                             "weight_decay is 0: set weight_decay= (with optimizer=adamw, sgd or adafactor)")
        if self.grad_accum_steps < 1 or self.batch_size % self.grad_accum_steps:
            raise ValueError(f"grad_accum_steps={self.grad_accum_steps} must be >= 1 and divide batch_size="
                             f"{self.batch_size}")
        self._check_rampup()
        if self.eval_split is not None and self.eval_data is None:
            raise ValueError(f"eval_split={self.eval_split} is the records of eval_data=, and no eval_data is given: "
                             "add eval_data=PATH (the same path as data= for a held-out slice of it)")
        data, weights = self.data_source, self.data_weights
        if isinstance(data, dict) and self.mode == "train":  # (the evaluator reads eval_data only)
            from loader.planning.mixture import check_weights

            if weights is None:  # the loader's line gives the Python form, weights={'web': 1, ...}
                raise ValueError(f"a mixture of {list(data)} needs weights=, e.g. weights="
                                 + ",".join(f"{name}=1" for name in data))
            check_weights(tuple(data), weights)  # one line for missing, unknown, negative or all-zero weights
        elif weights is not None:
            raise ValueError("weights= goes with a mixture, data=NAME=PATH,NAME=PATH (e.g. data=web=out/web,"
                             "code=out/code weights=web=0.7,code=0.3)")
        self.eval_source  # noqa: B018 - parses, or names what is wrong
        if self.strategy not in STRATEGIES:
            hint = did_you_mean([self.strategy], STRATEGIES)
            raise ValueError(f"strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}"
                             + (f" ({hint})" if hint else ""))
        self._check_job()
        if self.device is not None and self.strategy != "one_device":
            raise ValueError(f"device={self.device!r} picks strategy=one_device's device; strategy={self.strategy!r} "
                             "places the step itself: drop device=, or pass strategy=one_device")
        self._check_size()
        self._check_read()
        for name in ("add_bos", "add_eos"):
            if getattr(self, name) is not None and self.tokenizer is None:
                raise ValueError(f"{name}={str(getattr(self, name)).lower()} applies to text tokenised by tokenizer=; "
                                 "byte-level text always begins with BOS and has no EOS, token ids are read as they "
                                 "are (a pre-tokenized dataset's have the BOS and EOS its conversion gave them: "
                                 f"convert --{name.replace('_', '-')}): drop {name}=, or pass tokenizer= with text data")

    def _check_read(self) -> None:
        """A setting given otherwise than its default where this run does not read it (_READ_WHEN): one line naming
        what it is for and the fix, as adam_b1= with optimizer=sgd is refused."""
        for names, reads, purpose, instead, fix in _READ_WHEN:
            if reads(self):
                continue
            for name in names:
                if getattr(self, name) != _default(name):
                    raise ValueError(f"{name}={setting_text(getattr(self, name))} is for {purpose}, and this run has "
                                     f"{instead(self)}: drop {name}=, or {fix}")

    def _check_job(self):
        """coordinator_address, num_processes and process_id join processes into one job: under strategy=multi_worker
        alone (a mirrored run given them would train alone on each host, all writing one workdir), the address a
        HOST:PORT, the index one of the job's."""
        given = [n for n in ("coordinator_address", "num_processes", "process_id") if getattr(self, n) is not None]
        if given and self.strategy != "multi_worker":
            raise ValueError(f"{', '.join(f'{n}={getattr(self, n)}' for n in given)}: these join processes into "
                             f"one job under strategy=multi_worker only, and this run has strategy={self.strategy}: "
                             f"pass strategy=multi_worker, or drop {', '.join(n + '=' for n in given)}")
        address = self.coordinator_address
        if address is not None:
            host, _, port = str(address).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"coordinator_address={address!r} is not HOST:PORT: give process 0's host and a free "
                                 f"port, e.g. coordinator_address={host or address}:1234")
        if self.join_timeout <= 0:
            raise ValueError(f"join_timeout must be > 0 seconds (got join_timeout={self.join_timeout})")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1 (got num_processes={self.num_processes})")
        if self.process_id is not None and self.num_processes is not None and \
                not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id} is not one of the job's 0..{self.num_processes - 1} "
                             f"(num_processes={self.num_processes})")

    def _check_size(self):
        """width, depth, heads, mlp_ratio (and num_kv_heads, head_dim, mlp_dim where set): each >= 1, width a multiple
        of heads unless head_dim is set, num_kv_heads a divisor of heads; the layout's, attention's and remat's
        names: ones they know; all only for a model they size."""
        if isinstance(self.mlp_activations, (list, tuple)):  # a config file's list, as MaxText's yaml has it
            object.__setattr__(self, "mlp_activations", ",".join(map(str, self.mlp_activations)))
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in LM_KEYS}
        if self.use_iota_embed not in (True, False, "auto"):
            raise ValueError(f"use_iota_embed={self.use_iota_embed!r} is not one of auto, true, false")
        for name, allowed in (("attention", ATTENTIONS), ("remat", REMAT_CHOICES), ("normalization", NORMALIZATIONS),
                              ("position_embedding", POSITION_EMBEDDINGS)):
            if getattr(self, name) not in allowed:
                ours = MAXTEXT_ATTENTIONS.get(self.attention) if name == "attention" else None
                also = f" (MaxText's attention={self.attention} is attention={ours} here)" if ours else ""
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}{also}")
        activations = self.mlp_activations.split(",")
        unknown = [a for a in activations if a not in MLP_ACTIVATIONS]
        if unknown or not 1 <= len(activations) <= 2:
            raise ValueError(f"mlp_activations={self.mlp_activations!r} is not one or two of "
                             f"{', '.join(MLP_ACTIVATIONS)} (e.g. mlp_activations=gelu, or silu,linear for SwiGLU)")
        for name in SIZE_KEYS + ("num_kv_heads", "head_dim", "mlp_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                default = "unset" if defaults[name] is None else f"{name}={defaults[name]}"
                raise ValueError(f"{name} must be >= 1 (got {name}={getattr(self, name)}); the default is {default}")
        if self.rope_max_timescale <= 0:
            raise ValueError(f"rope_max_timescale must be > 0 (got rope_max_timescale={self.rope_max_timescale}); "
                             "the default is 10000")
        if self.rope_max_timescale != defaults["rope_max_timescale"] and self.position_embedding != "rope":
            raise ValueError(f"rope_max_timescale={self.rope_max_timescale:g} is for position_embedding=rope, and "
                             f"this model's is {self.position_embedding}: add position_embedding=rope, or drop "
                             "rope_max_timescale=")
        if not self.normalize_embedding_logits and not self.logits_via_embedding:
            raise ValueError("normalize_embedding_logits=false is for logits_via_embedding=true (tied embeddings): add "
                             "logits_via_embedding=true, or drop normalize_embedding_logits=")
        if not 0 < self.normalization_layer_epsilon < 1:
            raise ValueError(f"normalization_layer_epsilon must be in (0, 1) (got normalization_layer_epsilon="
                             f"{self.normalization_layer_epsilon}); the default is 1e-06")
        if self.num_kv_heads is not None and self.heads % self.num_kv_heads:
            divisors = [str(k) for k in range(1, self.heads + 1) if self.heads % k == 0]
            raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide heads={self.heads} (each key/value "
                             f"head serves heads / num_kv_heads query heads); use one of {', '.join(divisors)}")
        if self.head_dim is None and self.width % self.heads:
            fewer = max(h for h in range(1, self.heads) if self.width % h == 0)
            wider = -(-self.width // self.heads) * self.heads
            raise ValueError(f"width={self.width} is not divisible by heads={self.heads} (each head gets width / heads "
                             f"features); use heads={fewer} or width={wider}, or set head_dim=")
        head_dim = self.head_dim or self.width // self.heads
        if self.position_embedding == "rope" and head_dim % 2:
            raise ValueError(f"position_embedding=rope turns pairs of a head's features, and heads have {head_dim} "
                             f"(an odd number): set head_dim= to an even number")
        changed = [name for name in LM_KEYS if getattr(self, name) != defaults[name]]
        if changed and self.model not in SIZED_MODELS:
            name = changed[0]
            verb = "sizes" if name in SIZE_KEYS else "is for"
            raise ValueError(f"{name}={setting_text(getattr(self, name))} {verb} model={' or '.join(SIZED_MODELS)}; "
                             f"model={self.model!r} does not take it: drop {name}=")

    def _check_numbers_and_paths(self) -> None:
        """Every float finite (nan passed `x <= 0` checks, and the run stopped at its first step telling to lower
        learning_rate); a workdir named; compilation_cache's off words ("off" named a directory ./off)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name}={value} is not a finite number")
        workdir = str(self.workdir)
        if not workdir.strip():
            raise ValueError("workdir= is empty: name the run's directory (a local path or gs://bucket/run)")
        if not storage.is_remote(workdir) and os.path.isfile(workdir):
            raise ValueError(f"workdir={self.workdir} is a file, not a directory: name the run's directory")
        cache = self.compilation_cache.strip()
        if cache.lower() in ("none", "off", "false", "no", "0"):
            object.__setattr__(self, "compilation_cache", "none")
        elif cache.lower() == "auto":
            object.__setattr__(self, "compilation_cache", "auto")
        elif not cache:
            raise ValueError("compilation_cache= is empty: pass auto, none, or a directory")

    @classmethod
    def from_args(cls, overrides: list[str], config_file: str | None = None) -> TrainConfig:
        values: dict = {}
        if config_file is not None:
            loaded = _config_file(config_file)
            values.update(loaded)
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"argument {item!r} is not key=value (e.g. steps=500)")
            values[key] = raw
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            maxtext = [f"{name} is {MAXTEXT_NAMES[name]} here" if name in MAXTEXT_NAMES else
                       f"{name}: {MAXTEXT_ELSEWHERE[name]}" for name in unknown
                       if name in MAXTEXT_NAMES or name in MAXTEXT_ELSEWHERE]
            others = [name for name in unknown if name not in MAXTEXT_NAMES and name not in MAXTEXT_ELSEWHERE]
            hint = "; ".join(h for h in (f"MaxText's names: {'; '.join(maxtext)}" if maxtext else "",
                                         did_you_mean(others, fields) if others else "") if h)
            raise ValueError(f"unknown config key(s) {unknown}" + (f"; {hint}" if hint else "")
                             + " (python -m trainer --help lists every key)")
        if values.get("mode") == "evaluate" and "data" not in values and "eval_data" in values:
            values["data"] = values["eval_data"]  # the evaluator reads eval_data only
        missing = [k for k in ("data", "workdir") if k not in values]
        if missing:
            raise ValueError(f"missing required key(s) {missing}, e.g. data=out/train workdir=/tmp/run")
        return cls(**{k: _coerce(k, v, fields[k].type) for k, v in values.items()})


def _yaml_problem(e: Exception) -> str:
    """yaml's error in one line: what it expected, and where (line, column), with the hint a split's slice needs."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem is None or mark is None:
        return " ".join(str(e).split())
    line = mark.buffer.splitlines()[mark.line].strip() if mark.buffer else ""
    hint = ("; quote a split's slice, split: \"[:99%]\" (YAML reads [ as a list)"
            if "[" in line and ("split" in line or "%" in line) else "")
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" + (f" ({line})" if line else "") + hint


def _config_file(path: str) -> dict:
    """A config file's keys: JSON, or YAML (.yml, .yaml) as MaxText writes its configs."""
    yaml_file = path.endswith((".yml", ".yaml"))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file{near_path(path)}")
    with open(path) as f:
        try:
            if yaml_file:
                import yaml

                loaded = yaml.safe_load(f.read())  # (a string: its errors quote the line)
            else:
                loaded = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {path} is not JSON: {e} (a YAML file takes the suffix .yml or .yaml)") from None
        except Exception as e:  # noqa: BLE001 - yaml's errors (yaml.YAMLError), imported only for YAML files
            raise ValueError(f"--config {path} is not YAML: {_yaml_problem(e)}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path} holds a {type(loaded).__name__}; it must be a mapping of keys, e.g. "
                         '{"steps": 500, "strategy": "mirrored"} (JSON) or steps: 500 (YAML)')
    return loaded


def _coerce(key: str, value, annotation):
    hint = eval(annotation, {}, {}) if isinstance(annotation, str) else annotation  # noqa: S307 - our own annotations
    options = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(hint, types.UnionType) else [hint]
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    if not isinstance(value, str):
        return _typed(key, value, options, optional)
    if value.lower() in ("none", "null") and isinstance(hint, types.UnionType):
        return None
    for option in options:
        if option is bool:
            if (flag := booleans.parse(value)) is not None:
                return flag
            continue
        try:
            return option(value)
        except ValueError:
            continue
    names = " or ".join(o.__name__ if o is not bool else "bool (true or false)" for o in options)
    raise ValueError(f"{key}={value!r} is not a valid {names}")


def _typed(key: str, value, options: list, optional: bool):
    """A config file's value (JSON or YAML: already typed) checked against its key's type, as the command line's
    strings are converted: it went on as it was, and the run failed later with a traceback that named no key."""
    names = " or ".join(o.__name__ if o is not bool else "bool (true or false)" for o in options)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{key}: null is not a valid {names} (--config)")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if isinstance(value, bool):
            continue  # (a bool is an int to Python; YAML reads on/off/yes/no as booleans)
        if option is int and (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
            return int(value)  # (JSON's 1e3 is a float)
        if option is float and isinstance(value, (int, float)):
            return float(value)
        if option is str:
            return str(value) if isinstance(value, (int, float)) else value  # (a mixture's {name: path} too)
    trap = " (YAML reads on/off/yes/no as true/false: quote it)" if isinstance(value, bool) else ""
    raise ValueError(f"{key}={value!r} (--config) is not a valid {names}{trap}")


# The loader's option names -> the trainer's settings that set them (in the loader's error messages).
_TRAINER_NAMES = {"worker_count": "data_workers", "ray_address": "data_ray_address",
                  "ray_resources": "data_ray_resource", "cache_bytes": "data_cache_bytes", "cache_dir": "data_cache_dir"}
_LOADER_NAMES = re.compile(r"\b(?:" + "|".join(_TRAINER_NAMES) + r")\b")

_NAME = re.compile(r"[A-Za-z_][\w.-]*=")


def mixture_of(value: str | dict, key: str) -> str | dict[str, str]:
    """A path as it is; NAME=PATH,NAME=PATH (or a config file's {name: path}) as a mixture's {name: path}."""
    if isinstance(value, dict):
        return dict(value)
    if "=" in value and _local_path(value):
        return value  # a directory named hive-style (k=v), not a mixture
    items = value.split(",")
    if not all(_NAME.match(item) for item in items):
        if any(_NAME.match(item) for item in items) or "," in value and "=" in value:
            raise ValueError(f"{key}={value!r} mixes NAME=PATH items with plain paths; a mixture is "
                             f"{key}=web=out/web,code=out/code")
        return value
    pairs = _pairs(value, key)
    if len(pairs) == 1:
        [(name, path)] = pairs.items()
        if not storage.is_remote(path) and not _local_path(path):
            raise ValueError(f"{key}={value} reads as a mixture of one, {name}={path}, and {path} does not exist: a "
                             f"path holding '=' is written ./{value}")
    return pairs


def _local_path(path: str) -> bool:
    """Whether `path` names a local file or directory, or is a glob matching one."""
    import glob

    return not storage.is_remote(path) and (os.path.exists(path) or glob.has_magic(path) and bool(glob.glob(path)))


def _pairs(text: str, key: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{key}={text!r}: {item!r} is not NAME=VALUE (e.g. {key}=web=...,code=...)")
        if name in pairs:
            raise ValueError(f"{key}={text!r} names {name!r} twice")
        pairs[name] = value
    return pairs
