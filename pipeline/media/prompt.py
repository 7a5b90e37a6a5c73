"""A prompt's images, end to end on a CPU worker: the chat's image parts fetched, decoded and
processed with the model's own processor, and the rendered prompt's placeholders expanded.

Shared by the batch prompt stage and Serve, so an image in a job and the same image in a
request reach the engine as identical inputs. Errors name the part (messages[0].content[1],
or the image column) and the reason; the caller makes them an error row or a 400.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engines.api import ImageInput
from pipeline.media.fetch import decode_image, fetch_image
from pipeline.media.process import ImageError, VisionProcessor
from pipeline.openai.chat import TOKENIZER_FILES, PromptError, chat_images
from pipeline.spec import ModelSpec, StorageSpec
from pipeline.spec.images import ImagesSpec
from pipeline.storage import materialize_model

# Engine kinds that run the model's image processor themselves and take each image's file
# (ImageInput.source) instead of the prompt stage's pixels: TensorRT-LLM 1.2 re-processes
# every image from its decoded form. The prompt stage still processes the image, for its
# token count (context checks, cost), but sends no pixels.
SOURCE_KINDS = frozenset({"trtllm"})


class PromptImages:
    """Per process: the model's image processor (None for a text model), the limits and the
    storage that s3:// images are read with."""

    def __init__(
        self,
        model_dir: str | Path,
        limits: ImagesSpec,
        storage: StorageSpec | None,
        *,
        source: bool = False,
    ) -> None:
        self.limits = limits
        self.storage = storage
        # True: each input carries the image file and no pixels (SOURCE_KINDS).
        self.source = source
        self.model_dir = Path(model_dir)
        self._processor: VisionProcessor | None = None
        self._refusal: str | None = None
        self._loading = threading.Lock()  # Serve reads images on several threads

    @classmethod
    def for_model(
        cls,
        model: ModelSpec,
        limits: ImagesSpec,
        storage: StorageSpec,
        *,
        read_s3: bool,
        engine_kind: str,
    ) -> PromptImages:
        """The reader of `model`'s images: its config and processor files only (the files its
        tokenizer came from, so no weights are fetched). `read_s3`: whether s3:// images are
        read with `storage` (batch jobs) or refused (Serve). `engine_kind`: what the images
        are made for (pixels, or the file for SOURCE_KINDS)."""
        model_dir = materialize_model(
            model.path, model.cache_dir, storage, patterns=TOKENIZER_FILES, field="model.path"
        )
        return cls(
            model_dir,
            limits,
            storage if read_s3 else None,
            source=engine_kind in SOURCE_KINDS,
        )

    def processor(self) -> VisionProcessor:
        """The model's processor, loaded on the first image; PromptError for a text model."""
        with self._loading:
            if self._processor is None and self._refusal is None:
                try:
                    self._processor = VisionProcessor(self.model_dir)
                except ImageError as exc:
                    self._refusal = str(exc)
        if self._processor is None:
            raise PromptError(f"the prompt has images, but {self._refusal}")
        return self._processor

    def inputs(self, chat: Sequence[Mapping[str, Any]]) -> tuple[ImageInput, ...]:
        """The engine inputs of a validated chat's images, in order (none: empty)."""
        images = chat_images(chat)
        if not images:
            return ()
        processor = self.processor()
        if len(images) > self.limits.max_images:
            raise PromptError(
                f"the prompt has {len(images)} images; at most {self.limits.max_images} "
                "(prompt.images.max_images)"
            )
        out = []
        for url, where in images:
            try:
                data = fetch_image(url, self.limits, self.storage)
                made = processor.process(decode_image(data, self.limits))
                if self.source:
                    made = dataclasses.replace(made, pixel_values=b"", source=data)
                out.append(made)
            except ImageError as exc:
                raise PromptError(f"{where}: {exc}") from None
            except Exception as exc:  # the model's processor on an image it cannot take
                raise PromptError(
                    f"{where}: the model's image processor failed ({type(exc).__name__}: {exc})"
                ) from None
        return tuple(out)

    def expand(self, token_ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """The rendered prompt with each image's placeholder repeated for its tokens."""
        try:
            return self.processor().expand(token_ids, images)
        except ImageError as exc:
            raise PromptError(str(exc)) from None
