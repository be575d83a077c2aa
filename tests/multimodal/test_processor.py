"""The request-side pipeline: content parts in order, --limit-mm-per-prompt in vLLM's JSON form, placeholder
expansion equal to transformers' Qwen3VLProcessor (committed fixture), MRoPE positions (the doc's worked example),
and the MultimodalInput the engine carries (pickling, per-chunk embedding slices, decode positions)."""

from __future__ import annotations

import base64
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deltaserve.multimodal import MediaLimitError, MediaRequestError, MultimodalProcessor, parse_limit_mm_per_prompt
from deltaserve.multimodal.media import LoadedImage, LoadedVideo
from deltaserve.multimodal.positions import mrope_positions, token_types
from deltaserve.multimodal.prompt import VisionTokenIds
from deltaserve.multimodal.video import VideoMetadata
from tests.multimodal.processor_cases import PROMPT_CASE
from tests.multimodal.synthetic import synthetic_image, synthetic_video
from tests.support.vision import tiny_vision_checkpoint

FIXTURES = json.loads((Path(__file__).parent / "data" / "processor_fixtures.json").read_text())
IMAGE, VIDEO, START, END = 90, 91, 80, 81
TOKENS = VisionTokenIds(IMAGE, VIDEO, START, END)


def png_url(height: int = 8, width: int = 8) -> str:
    buffer = io.BytesIO()
    Image.fromarray(synthetic_image(height, width)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def tiny() -> tuple[Path, object, MultimodalProcessor]:
    from transformers import AutoTokenizer

    model_dir = tiny_vision_checkpoint("dense-vl")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tokens = VisionTokenIds(config["image_token_id"], config["video_token_id"], config["vision_start_token_id"],
                            config["vision_end_token_id"])  # fmt: skip
    processor = MultimodalProcessor.from_model_dir(
        model_dir, tokens, lambda text: tokenizer.encode(text, add_special_tokens=False),
        limit_mm_per_prompt='{"image": 2, "video": {"count": 1, "num_frames": 32}}',
    )  # fmt: skip
    return model_dir, tokenizer, processor


def test_chat_expansion_equals_transformers_processor(tiny: tuple) -> None:
    """Template text -> ids -> expansion with timestamps: the same ids, token types and grids as transformers'
    Qwen3VLProcessor (torchvision backend) recorded in the fixture."""
    _, tokenizer, processor = tiny
    expected = FIXTURES["prompt"]
    text = tokenizer.apply_chat_template(PROMPT_CASE["messages"], tokenize=False, add_generation_prompt=True)
    assert text == expected["text"]
    images = [LoadedImage(synthetic_image(s["height"], s["width"], s["seed"]), "i") for s in PROMPT_CASE["images"]]
    spec = PROMPT_CASE["video"]
    frames = synthetic_video(spec["frames"], spec["height"], spec["width"], spec["seed"])
    video = LoadedVideo(frames, VideoMetadata(spec["frames"], spec["fps"], tuple(range(spec["frames"]))), False, "v")
    ids, mm_input = processor.process_loaded(tokenizer.encode(text, add_special_tokens=False),
                                             [images[0], video, images[1]])  # fmt: skip
    assert ids == expected["input_ids"]
    assert token_types(ids, processor.tokens.image, processor.tokens.video).tolist() == expected["mm_token_type_ids"]
    assert [list(it.grid_thw) for it in mm_input.items if it.modality == "image"] == expected["image_grid_thw"]
    assert [list(it.grid_thw) for it in mm_input.items if it.modality == "video"] == expected["video_grid_thw"]
    # spans: every pad lies in exactly one embed run, in item order; a video span covers its timestamps
    pads = [i for i, t in enumerate(ids) if t in (processor.tokens.image, processor.tokens.video)]
    runs = [p for it in mm_input.items for first, n in it.embed_runs for p in range(first, first + n)]
    assert sorted(runs) == pads
    video_item = mm_input.items[1]
    assert ids[video_item.offset - 1] == processor.tokens.vision_start
    assert ids[video_item.end] == processor.tokens.vision_end
    assert len(video_item.embed_runs) == video_item.grid_thw[0]


def test_content_parts_limits_and_errors(tiny: tuple) -> None:
    _, _, processor = tiny
    messages = [
        {"role": "system", "content": "hi"},
        {"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": png_url()}},
            {"image_url": png_url(16, 16)}, {"type": "video", "video": [png_url(), png_url()]},
        ]},
    ]  # fmt: skip
    refs = processor.parse_messages(messages)
    assert [(r.modality, r.location) for r in refs] == [
        ("image", "messages[1].content[1]"), ("image", "messages[1].content[2]"), ("video", "messages[1].content[3]"),
    ]  # fmt: skip
    too_many = messages + [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url()}}]}]
    with pytest.raises(MediaLimitError, match=r"At most 2 image\(s\) may be provided in one prompt"):
        processor.parse_messages(too_many)
    with pytest.raises(MediaRequestError, match=r"messages\[0\].content\[0\]: `image_url`"):
        processor.parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(MediaRequestError, match=r"0 image placeholder\(s\) for 1 image"):
        processor.process([1, 2, 3], refs[:1])
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: .*text/plain"):
        processor.process([processor.tokens.image], processor.parse_messages(bad))


def test_limit_mm_per_prompt_json_forms() -> None:
    assert parse_limit_mm_per_prompt(None) == {"image": 999, "video": 999}
    assert parse_limit_mm_per_prompt('{"image": 0}') == {"image": 0, "video": 999}
    assert parse_limit_mm_per_prompt({"video": {"count": 2, "num_frames": 8}, "image": 5}) == {"image": 5, "video": 2}
    for bad in ("image=2", '{"image": -1}', '{"image": "2"}', "[1]"):
        with pytest.raises(ValueError, match="limit-mm-per-prompt"):
            parse_limit_mm_per_prompt(bad)


def test_worked_example_positions() -> None:
    """Multimodal doc §5.3: 5 text, vision_start, grid (1, 8, 12) -> 24 pads, vision_end, 4 text; delta -18."""
    ids = [1] * 5 + [START] + [IMAGE] * 24 + [END] + [2] * 4
    positions, delta = mrope_positions(token_types(ids, IMAGE, VIDEO), [(1, 8, 12)], [], 2)
    assert delta == -18
    assert positions[:, 5].tolist() == [5, 5, 5]
    assert positions[:, 6:12].tolist() == [[6] * 6, [6] * 6, list(range(6, 12))]
    assert positions[:, 24:30].tolist() == [[6] * 6, [9] * 6, list(range(6, 12))]
    assert positions[:, 30].tolist() == [12, 12, 12] and positions[:, 34].tolist() == [16, 16, 16]


def test_multimodal_input_is_plain_data(tiny: tuple) -> None:
    _, tokenizer, processor = tiny
    pixels = synthetic_image(64, 64, 9)
    prompt = [5, 6, START, processor.tokens.image, END, 7]
    ids, mm_input = processor.process_loaded(prompt, [LoadedImage(pixels, "d")])
    clone = pickle.loads(pickle.dumps(mm_input))
    np.testing.assert_array_equal(clone.items[0].pixel_values, mm_input.items[0].pixel_values)
    item = mm_input.items[0]
    assert item.num_embeds == 64 and item.grid_thw == (1, 16, 16) and len(ids) == 5 + 64
    # a window cutting the pad run consumes the matching rows of the item's encoder output
    first = item.embed_runs[0][0]
    (head,) = mm_input.embed_slices(0, first + 10)
    (tail,) = mm_input.embed_slices(first + 10, len(ids))
    assert (head.src_start, head.src_end, head.dst_start) == (0, 10, first)
    assert (tail.src_start, tail.src_end, tail.dst_start) == (10, 64, 0)
    assert mm_input.items_in_window(0, first) == [] and mm_input.items_in_window(first + 63, first + 64) == [0]
    # decode: index + delta on all three axes, right after the prompt's table
    decode = mm_input.positions(len(ids) - 1, len(ids) + 2)
    assert decode[:, 0].tolist() == mm_input.mrope_positions[:, -1].tolist()
    assert decode[:, 1].tolist() == [len(ids) + mm_input.mrope_delta] * 3
    assert decode[0, 1] == mm_input.mrope_positions.max() + 1


def test_frame_list_video_end_to_end(tiny: tuple) -> None:
    """A {"type": "video", "video": [frame URLs], "fps": 2} part: frames kept as sent, timestamps from their
    indices and fps, one vision_start/pads/vision_end per temporal group inside the template's pair."""
    _, tokenizer, processor = tiny
    frames = [png_url(64, 64) for _ in range(3)]
    refs = processor.parse_messages([{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2}]}])
    tokens = processor.tokens
    ids, mm_input = processor.process([7, tokens.vision_start, tokens.video, tokens.vision_end, 8], refs)
    (item,) = mm_input.items
    assert item.modality == "video" and item.grid_thw == (2, 4, 4) and len(item.embed_runs) == 2
    stamps = [tokenizer.encode(t, add_special_tokens=False) for t in ("<0.2 seconds>", "<1.0 seconds>")]
    group = [tokens.vision_start] + [tokens.video] * 4 + [tokens.vision_end]
    assert ids == [7, tokens.vision_start] + stamps[0] + group + stamps[1] + group + [tokens.vision_end, 8]


def test_video_file_sampled_while_decoding_equals_whole_decode(tiny: tuple, tmp_path: Path) -> None:
    """A video file keeps only the processor's sampled frames while decoding; the result equals decoding every
    frame and letting the processor sample (transformers' path), ids and pixels alike."""
    from dataclasses import replace

    from deltaserve.multimodal.media import MediaLoader
    from tests.multimodal.test_media import write_video

    _, _, processor = tiny
    frames = synthetic_video(9, 32, 64, seed=11)
    write_video(tmp_path / "clip.mkv", frames, fps=3)
    local = replace(processor, loader=MediaLoader(tmp_path))
    tokens = processor.tokens
    prompt = [5, tokens.vision_start, tokens.video, tokens.vision_end]
    part = {"type": "video_url", "video_url": {"url": f"file://{tmp_path}/clip.mkv"}}
    refs = local.parse_messages([{"role": "user", "content": [part]}])
    loaded = local.load(refs[0])
    assert loaded.frames.shape[0] == 6 and loaded.metadata.frames_indices == (0, 2, 3, 5, 6, 8)
    ids, mm_input = local.process(prompt, refs)
    whole = LoadedVideo(frames, VideoMetadata(9, 3.0, tuple(range(9))), True, "w")
    ids_whole, mm_whole = processor.process_loaded(prompt, [whole])
    assert ids == ids_whole
    np.testing.assert_array_equal(mm_input.items[0].pixel_values, mm_whole.items[0].pixel_values)
    np.testing.assert_array_equal(mm_input.mrope_positions, mm_whole.mrope_positions)
