"""Texts on which Skiff's tokenizer must give exactly llama.cpp's token ids.

Chosen for the places tokenizers disagree: whitespace runs and their position, scripts without
spaces, multi-code-point emoji, digits, contractions, byte fallback, and text that looks like
special tokens (with and without `special=True`).
"""

CORPUS: list[str] = [
    # empty and whitespace
    "",
    " ",
    "  ",
    "   x",
    "x   ",
    "\n",
    "\n\n\n",
    "\t\t",
    "\t\tindented\twith tabs",
    " \n \n",
    "a\r\nb\r\n",
    "trailing space ",
    "two  spaces  between   words",
    "line one\nline two\n\n\nline five",
    "\u00a0non-breaking\u2003em space\u3000ideographic",
    # English prose
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and a sentence.",
    "It was the best of times, it was the worst of times; it was the age of wisdom...",
    "HELLO WORLD in CAPS, MiXeD CaSe, camelCase and snake_case_names.",
    # contractions
    "don't",
    "I'LL be there, we've done it, they're here, she'd go, it's fine, I'm sure.",
    "DON'T SHOUT, WE'VE HEARD YOU",
    "rock 'n' roll ' quoted ' words",
    # numbers
    "1234567890",
    "3.14159265358979323846",
    "1,000,000 and 1.000.000,00",
    "-42 +7 1e-9 0x1F 0b1010 007",
    "Call 555-0123 at 10:45pm on 2024-03-15.",
    "12345678901234567890123456789012345678901234567890",
    # European languages
    "Le café est très bon, n'est-ce pas? À bientôt, Noël, garçon, œuvre.",
    "Die Straße ist groß. Fußgänger müssen Äpfel über die Brücke tragen.",
    "¿Dónde está la biblioteca? ¡Olé! El niño comió piñata.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε! Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy.",
    # right-to-left and Indic scripts
    "مرحبا بالعالم! كيف حالك اليوم؟",
    "שלום עולם! מה שלומך?",
    "नमस्ते दुनिया! आप कैसे हैं?",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    # CJK
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "こんにちは世界！カタカナとひらがなと漢字を混ぜた文章です。",
    "안녕하세요 세계! 한국어 문장입니다.",
    "東京タワーは1958年に完成しました。",
    # emoji
    "🤖",
    "I love pizza 🍕🍕🍕!",
    "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag",
    "🇫🇷🇩🇪🇯🇵 flags and 👍🏻👍🏿 skin tones",
    "new emoji 🫨🩷🪿 and symbols ★☆♠♣ ∑∫√∞ ≠ ≤ ≥ → ⇒",
    # combining marks and rare characters
    "e\u0301 a\u0308 n\u0303 (decomposed accents)",
    "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇",
    "\u200bzero\u200bwidth\u200b and \u200djoiner",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐛𝐨𝐥𝐝 and private use \ue000\U000f0000",
    "control chars \x00\x01\x07\x1b[31m escape",
    # code
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    (
        'class Foo:\n    """Docstring."""\n\n'
        '    def __init__(self) -> None:\n        self.x = {"k": [1, 2]}\n'
    ),
    '#include <stdio.h>\n\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    '{"name": "Skiff", "version": 1.0, "tags": ["llm", "gguf"], "nested": {"ok": true, "n": null}}',
    "for f in *.txt; do echo \"$f\" | grep -v '^#' >> out.log 2>&1; done && ls -la ~/",
    "    if (x != y && z >= 0) { a[i++] = b->c; }  // comment",
    '<div class="a"><p>Hello <b>bold</b> <i>it</i></p></div>',
    "SELECT * FROM users WHERE id = 42 ORDER BY name DESC;",
    # URLs and mixed punctuation
    "https://example.com/path/to/page?query=1&lang=en#section",
    "Email me at someone@example.org or visit www.example.co.uk!!!",
    "... --- *** ___ ### !!! ??? ;;; ::: ,,, ~~~ ===",
    # special-token text
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>",
    "</s>",
    "<s>[INST] hello [/INST]</s>",
    "<|endoftext|><|endoftext|>",
    "text<unk>between<pad>tokens<eos>",
    "<unused12> and <|im_end|> inline <end_of_turn>",
    "<start_of_turn",
    "<<|im_start|>>",
    # long mixed paragraph
    (
        "In 2023, researchers at Größe-Labs (https://example.org) released model v2.5 — "
        "trained on 1,234,567 documents in 42 languages: English, Français, Deutsch, Русский, "
        "中文, 日本語, 한국어, العربية, עברית, हिन्दी and ไทย.\n\nResults:\n"
        "  - accuracy: 97.3% (±0.2)\n  - latency:  12ms 🚀\n\t- cost: $0.002/1k tokens\n"
        "They said \"it's 'good enough'\"; we'll see. <|im_end|> Done!!! 🎉🎉"
    ),
]
