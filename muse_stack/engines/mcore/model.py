"""The Muse Spark causal LM on megatron-core: embedding (+ parameter-free norm), the decoder
layers of this pipeline stage, and on the last stage the final norm, the vocab-parallel
output layer, ``logits x output_multiplier`` with the softcap, and the per-token loss: one
compiled chain from the output matmul to the loss when the elementwise chains are compiled and
the vocabulary is not split over TP; otherwise the softcap, then megatron-core's vocab-parallel
cross-entropy (which, eager, launches fewer kernels than the chain would).

With perception towers (image-text recipes) the first stage also holds transformers' vision
tower, audio tower and projector under ``perception.`` (the reference modules of
:mod:`muse_stack.models.muse_spark.perception`, in the recipe's parameter dtype), whole on every GPU of the
stage: transformers states no tensor-parallel layout for them. The text embedding reads the
placeholders as id 0; the media's feature rows then replace them by the micro-batch's
``media_index`` (:func:`muse_stack.models.muse_spark.perception.media_index`, made before the sequence is
split over CP ranks), each TP rank placing the rows of its own sequence chunk under sequence
parallelism. Under sequence parallelism each rank's towers see the gradient of its chunk only,
so their parameters are marked ``sequence_parallel`` and megatron-core's
``finalize_model_grads`` sums their gradients over the TP group, as it does for the norms.
Without it every TP rank gets the whole (identical) gradient."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.module import MegatronModule

from muse_stack.engines.mcore import fuse
from muse_stack.engines.mcore.chains import hold_padding_row, softcap_cross_entropy, softcap_logits, weightless_norm
from muse_stack.engines.mcore.layers import MuseSparkBlock
from muse_stack.engines.mcore.spec import muse_spark_layer_spec
from muse_stack.models.muse_spark.loss import IGNORE_INDEX
from muse_stack.models.muse_spark.perception import media_features, place_media, text_input_ids
from muse_stack.models.muse_spark.config import ModelConfig


class MuseSparkMCore(MegatronModule):
    """One pipeline stage (all of the model when PP = 1). Parameter names: see .weights."""

    def __init__(self, config, muse: ModelConfig, *, seq_length: int, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None, pp_rank: int = 0, towers=None,
                 seed: int = 0, recompute_towers: bool = False) -> None:
        super().__init__(config=config)
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder
        # input and output embeddings are untied: nothing to all-reduce between first and last stage
        self.share_embeddings_and_output_weights = False
        self.muse = muse
        self.pre_process, self.post_process = pre_process, post_process
        self.cp_size = pg_collection.cp.size() if pg_collection is not None else 1
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, muse.vocab_size, seq_length, position_embedding_type="rope",
                                                    tp_group=pg_collection.tp if pg_collection else None)
            words = self.embedding.word_embeddings  # the pad row learns nothing, as transformers' padding_idx
            #: the pad row's gradient hook (None: the row is not on this rank) and its row in this rank's part
            self.padding_hook = hold_padding_row(words.weight, muse.pad_token_id, words.vocab_start_index,
                                                 words.vocab_end_index)
            self.pad_row = muse.pad_token_id - words.vocab_start_index if self.padding_hook is not None else None
        #: the towers' config (None: a text model); the modules sit on the first stage only
        self.towers = towers
        self.perception = None
        if pre_process and towers is not None:
            self.perception = build_perception(config, muse, towers, seed=seed, recompute=recompute_towers)
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        theta = muse.rope_theta
        self.rotary_pos_emb = RotaryEmbedding(muse.head_dim, rotary_percent=1.0,
                                              rotary_base=int(theta) if float(theta).is_integer() else theta,
                                              cp_group=pg_collection.cp if pg_collection else None)
        self.decoder = MuseSparkBlock(config, muse_spark_layer_spec(), muse, pre_process, post_process,
                                      pg_collection=pg_collection, pp_rank=pp_rank)
        #: the vocabulary is split over TP: the loss then needs megatron-core's vocab-parallel form
        if pg_collection is not None:
            self.vocab_split = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state as ps

            self.vocab_split = ps.get_tensor_model_parallel_world_size()
        if post_process:
            self.output_layer = TEColumnParallelLinear(
                config.hidden_size, muse.vocab_size, config=config, init_method=config.output_layer_init_method,
                gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                tp_group=pg_collection.tp if pg_collection else None)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, packed_seq_params=None, media: dict | None = None,
                media_index: torch.Tensor | None = None) -> torch.Tensor:
        """Input ids [b, s] (this CP rank's tokens). The last stage returns the per-token loss
        [b, s] (fp32, 0 where not supervised) when labels are given, else the soft-capped
        logits [s, b, V/TP]; other stages return the fp32 residual stream.

        Packed rows (THD): ``input_ids`` is [1, tokens] and ``packed_seq_params`` carries the
        cumulative sequence lengths; positions restart at 0 in each sequence (RoPE) and no
        attention crosses a boundary, as in the reference model.

        ``media`` (transformers' argument names: ``pixel_values``, ``image_grid_thw``, ...) and
        ``media_index`` [b, s] (aligned with ``input_ids``) place the towers' features on the
        first stage; other stages ignore them."""
        stream = None
        if self.pre_process:
            ids = input_ids if self.towers is None else text_input_ids(input_ids, self.towers)
            stream = weightless_norm(self.embedding(ids, position_ids=None), self.muse.rms_norm_eps)
            if self.perception is not None and media:
                stream = self._place_media(stream, media, media_index)
        if packed_seq_params is not None:  # a table long enough for the longest sequence
            rotary = self.rotary_pos_emb(int(packed_seq_params.max_seqlen_q), packed_seq=True)
        else:
            rotary = self.rotary_pos_emb(input_ids.shape[1] * self.cp_size)
        hidden = self.decoder(stream, rotary, packed_seq_params)
        if not self.post_process:
            return hidden
        raw, _ = self.output_layer(hidden)
        multiplier, cap = self.muse.output_multiplier, self.muse.final_logit_softcapping
        if labels is None:
            return softcap_logits(raw, multiplier, cap)
        target = labels.transpose(0, 1).contiguous()
        mask = target != IGNORE_INDEX
        if loss_mask is not None:
            mask = mask & loss_mask.transpose(0, 1).to(torch.bool)
        target = torch.where(mask, target, 0)
        if self.vocab_split == 1 and fuse.enabled():  # the whole vocabulary here, compiled: one chain
            per_token = softcap_cross_entropy(raw, target, multiplier, cap)
        else:
            per_token = tensor_parallel.vocab_parallel_cross_entropy(softcap_logits(raw, multiplier, cap), target)
        return (per_token * mask).transpose(0, 1).contiguous()

    def _place_media(self, stream: torch.Tensor, media: dict, media_index: torch.Tensor) -> torch.Tensor:
        """The stream [s, b, H] (this rank's part under sequence parallelism) with the media's
        feature rows in their placeholders."""
        features = media_features(self.perception, self.towers, **media)
        if features is None:
            return stream
        index = media_index.transpose(0, 1)  # [s, b], as the stream
        if index.shape[0] != stream.shape[0]:  # sequence parallel: this TP rank's chunk of the sequence
            rank = self.tp_group.rank() if self.tp_group is not None else 0
            chunk = stream.shape[0]
            index = index[rank * chunk:(rank + 1) * chunk]
        return place_media(stream, features, index)


def build_perception(config, muse: ModelConfig, towers, *, seed: int, recompute: bool) -> torch.nn.Module:
    """transformers' perception modules, initialised as the reference model initialises them
    (the same seed gives the same tensors), in the recipe's parameter dtype."""
    from muse_stack.models.muse_spark.perception import MuseSparkPerception, init_perception_weights

    host = MuseSparkPerception(towers, text_hidden_size=muse.hidden_size, text_rms_norm_eps=muse.rms_norm_eps)
    init_perception_weights(host, seed, std=muse.initializer_range, prefix="model.")
    host.vision_tower.recompute = recompute
    host.to(dtype=config.params_dtype)
    for param in host.parameters():  # replicated over TP; summed over it when each rank sees its chunk only
        param.sequence_parallel = bool(config.sequence_parallel)
    return host


def build_model(config, muse: ModelConfig, seq_length: int, pg_collection=None, *, towers=None, seed: int = 0,
                recompute_towers: bool = False) -> MuseSparkMCore:
    from megatron.core import parallel_state as ps

    from muse_stack.engines.mcore.layers import set_matmul_dtype

    set_matmul_dtype(config.params_dtype)  # bf16, or fp32 under precision: fp32
    pp_rank = ps.get_pipeline_model_parallel_rank()
    return MuseSparkMCore(config, muse, seq_length=seq_length,
                          pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
                          post_process=ps.is_pipeline_last_stage(ignore_virtual=True),
                          pg_collection=pg_collection, pp_rank=pp_rank, towers=towers, seed=seed,
                          recompute_towers=recompute_towers)
