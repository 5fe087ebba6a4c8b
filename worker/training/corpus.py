"""The small English corpus the tiny model's byte-level BPE tokenizer is trained on.

A few KB of varied plain text plus the demo task's vocabulary, so that common words and the demo's
country and capital names become single tokens (short sequences, fast CPU training). Any other
text still tokenizes: the tokenizer falls back to bytes.
"""

from __future__ import annotations

from app.datasets import demo

_TEXT = """\
The morning train left the station a few minutes late, and most of the passengers did not notice.
A woman near the window was reading a long letter from her brother, who had moved to the coast
last spring. He wrote about the weather, the small house he was repairing, and the neighbours who
brought him bread on Sundays. She smiled at the part about the dog that refused to walk in the rain.

Learning a new language takes patience. At first every sentence feels like a puzzle with missing
pieces, and simple questions such as "Where is the library?" or "How much does this cost?" require
real effort. After a few months the words start to arrive on their own. You begin to think in the
new language, and one day you realise you understood a joke without translating it.

To make a simple tomato soup, cut two onions and three cloves of garlic, and cook them slowly in
olive oil. Add six ripe tomatoes, a cup of water, salt and pepper. Let the soup simmer for twenty
minutes, then blend it until it is smooth. Serve it hot with fresh bread and a little cheese.

Computers follow instructions exactly. A program is a list of steps: read the input, check that it
is valid, compute the answer, and write the result. When something goes wrong, a good engineer
reads the error message carefully, reproduces the problem with a small example, and fixes the
cause rather than the symptom. Tests make sure the fix stays fixed.

The history of science is full of surprises. People once believed that heavy objects fall faster
than light ones, until careful experiments showed otherwise. The planets move around the sun, the
moon pulls on the oceans, and light travels faster than anything else we know. Each discovery
answered one question and raised several new ones.

In the garden, the apple tree was covered with white flowers. Bees moved from one blossom to the
next, and a small bird watched them from the fence. By the end of summer there would be more apples
than the family could eat, so they planned to share them with friends and make cider in the autumn.

Numbers are everywhere: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,
twenty, thirty, forty, fifty, a hundred, a thousand. The first, second and third runners received
medals. Half of the group arrived early; the other half came at noon. Monday, Tuesday, Wednesday,
Thursday, Friday, Saturday and Sunday make a week. January, February, March, April, May, June,
July, August, September, October, November and December make a year.

Colours describe the world: red, orange, yellow, green, blue, purple, black, white, brown and grey.
The sky is blue on a clear day, grass is green, snow is white, and the night is dark. Animals live
in many places: the cat sleeps on the sofa, the horse runs in the field, the fish swims in the
river, and the eagle flies above the mountains.

A good answer is short, correct and polite. When someone asks a question, read it carefully, think
about what they really want to know, and reply in one clear sentence. If you are not sure, say so.
Questions often begin with what, which, who, where, when, why or how. Tell me, show me, explain,
name, list and describe are common instructions. Reverse the word, repeat the word, spell the word,
count the letters, translate the sentence, and summarise the text are common tasks.

You are a helpful assistant. You are a geography assistant. Answer in one sentence. The user asks
and the model answers. The capital of a country is the city where its government sits. Many
capitals are also the largest city of their country, but not all of them.
"""


def corpus_lines() -> list[str]:
    """The corpus, one line per item (text paragraphs' lines, then the demo vocabulary)."""
    lines = [line for line in _TEXT.splitlines() if line.strip()]
    for country, capital in demo.COUNTRIES:
        for question in demo.QUESTIONS:  # as often as in the demo data, so names merge into tokens
            lines.append(question.format(country=country))
            lines.append(demo.ANSWER.format(country=country, capital=capital))
    lines.append(demo.SYSTEM)
    return lines
