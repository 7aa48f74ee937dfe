"""`kvtier router` runs without torch: its modules, and the tokenizers it loads to name
requests' blocks, leave torch unimported (it starts sooner and holds less), while the
tokenizer it loads is the one an instance loads (engine/model_files.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.router.fake_instance import save_tokenizer

NO_TORCH = "import sys; assert 'torch' not in sys.modules, 'torch was imported'"


def test_the_routers_modules_leave_torch_out():
    code = f"import engine.cli, engine.router.app; {NO_TORCH}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_generic_fast_tokenizer_loads_without_torch(tmp_path):
    path = save_tokenizer(tmp_path)
    code = (f"from engine.model_files import load_tokenizer; t = load_tokenizer({path!r}); "
            f"assert t('w1 w2')['input_ids'] == [4, 5], t('w1 w2'); {NO_TORCH}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_tokenizer_loaded_without_torch_is_the_one_autotokenizer_loads(tmp_path):
    from transformers import AutoTokenizer

    from engine.model_files import load_tokenizer
    from engine.models.loader import tokenizer_digest
    from engine.random_model import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)  # the built-in models' tokenizer
    ours, auto = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(auto) and tokenizer_digest(ours) == tokenizer_digest(auto)
    assert ours.init_kwargs == auto.init_kwargs and ours.chat_template == auto.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂\n\tworld"}]
    for tokenizer in (ours, auto):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer(text)["input_ids"] == auto(text)["input_ids"]
