"""The verifier's vocabulary as a file of its own: the model's GGUF metadata (tokenizer,
chat template, the architecture's numbers) without a single tensor, the kind of file
llama.cpp keeps as models/ggml-vocab-*.gguf and loads with `vocab_only`. A drafter with
another tokenizer gets the verifier's from it (GET /vocab)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf


def vocab_only_gguf(model_path: Path) -> bytes:
    reader = gguf.GGUFReader(model_path)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    with tempfile.TemporaryDirectory(prefix="vocab-") as folder:
        target = Path(folder) / "vocab.gguf"
        writer = gguf.GGUFWriter(target, arch, endianess=reader.endianess)
        for field in reader.fields.values():
            # The architecture and the GGUF header's own fields are the writer's to write;
            # a split model's shard keys would make llama.cpp look for the other shards.
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith(
                ("GGUF.", "split.")
            ):
                continue
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        return target.read_bytes()
