"""The demo dataset: a toy chat task that the tiny model visibly learns on CPU in a few minutes.

"What is the capital of France?" -> "The capital of France is Paris." for about a hundred countries,
asked three ways, a quarter of the rows with a system prompt. The answer always has the same shape,
so the loss falls fast (the shape and the echoed country are easy; the capitals are memorised: after 800
steps at learning rate 0.003, batch 8, about 70% of the held-out questions are answered word for word).

Pure Python (no JAX): the one-click import (`POST /api/v1/datasets/demo`) calls :func:`demo_dataset_jsonl`.
"""

from __future__ import annotations

import json
import random

DEMO_FILENAME = "capitals-demo.jsonl"

COUNTRIES: tuple[tuple[str, str], ...] = (
    ("Afghanistan", "Kabul"),
    ("Albania", "Tirana"),
    ("Algeria", "Algiers"),
    ("Argentina", "Buenos Aires"),
    ("Armenia", "Yerevan"),
    ("Australia", "Canberra"),
    ("Austria", "Vienna"),
    ("Azerbaijan", "Baku"),
    ("Bangladesh", "Dhaka"),
    ("Belarus", "Minsk"),
    ("Belgium", "Brussels"),
    ("Bolivia", "Sucre"),
    ("Brazil", "Brasilia"),
    ("Bulgaria", "Sofia"),
    ("Cambodia", "Phnom Penh"),
    ("Cameroon", "Yaounde"),
    ("Canada", "Ottawa"),
    ("Chile", "Santiago"),
    ("China", "Beijing"),
    ("Colombia", "Bogota"),
    ("Croatia", "Zagreb"),
    ("Cuba", "Havana"),
    ("Cyprus", "Nicosia"),
    ("Denmark", "Copenhagen"),
    ("Ecuador", "Quito"),
    ("Egypt", "Cairo"),
    ("Estonia", "Tallinn"),
    ("Ethiopia", "Addis Ababa"),
    ("Finland", "Helsinki"),
    ("France", "Paris"),
    ("Georgia", "Tbilisi"),
    ("Germany", "Berlin"),
    ("Ghana", "Accra"),
    ("Greece", "Athens"),
    ("Guatemala", "Guatemala City"),
    ("Hungary", "Budapest"),
    ("Iceland", "Reykjavik"),
    ("India", "New Delhi"),
    ("Indonesia", "Jakarta"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
    ("Ireland", "Dublin"),
    ("Israel", "Jerusalem"),
    ("Italy", "Rome"),
    ("Jamaica", "Kingston"),
    ("Japan", "Tokyo"),
    ("Jordan", "Amman"),
    ("Kazakhstan", "Astana"),
    ("Kenya", "Nairobi"),
    ("Kuwait", "Kuwait City"),
    ("Latvia", "Riga"),
    ("Lebanon", "Beirut"),
    ("Libya", "Tripoli"),
    ("Lithuania", "Vilnius"),
    ("Luxembourg", "Luxembourg"),
    ("Madagascar", "Antananarivo"),
    ("Malaysia", "Kuala Lumpur"),
    ("Mali", "Bamako"),
    ("Malta", "Valletta"),
    ("Mexico", "Mexico City"),
    ("Mongolia", "Ulaanbaatar"),
    ("Morocco", "Rabat"),
    ("Mozambique", "Maputo"),
    ("Nepal", "Kathmandu"),
    ("Netherlands", "Amsterdam"),
    ("New Zealand", "Wellington"),
    ("Nicaragua", "Managua"),
    ("Nigeria", "Abuja"),
    ("North Korea", "Pyongyang"),
    ("Norway", "Oslo"),
    ("Oman", "Muscat"),
    ("Pakistan", "Islamabad"),
    ("Panama", "Panama City"),
    ("Paraguay", "Asuncion"),
    ("Peru", "Lima"),
    ("Philippines", "Manila"),
    ("Poland", "Warsaw"),
    ("Portugal", "Lisbon"),
    ("Qatar", "Doha"),
    ("Romania", "Bucharest"),
    ("Russia", "Moscow"),
    ("Rwanda", "Kigali"),
    ("Saudi Arabia", "Riyadh"),
    ("Senegal", "Dakar"),
    ("Serbia", "Belgrade"),
    ("Singapore", "Singapore"),
    ("Slovakia", "Bratislava"),
    ("Slovenia", "Ljubljana"),
    ("South Africa", "Pretoria"),
    ("South Korea", "Seoul"),
    ("Spain", "Madrid"),
    ("Sri Lanka", "Colombo"),
    ("Sudan", "Khartoum"),
    ("Sweden", "Stockholm"),
    ("Switzerland", "Bern"),
    ("Syria", "Damascus"),
    ("Tanzania", "Dodoma"),
    ("Thailand", "Bangkok"),
    ("Tunisia", "Tunis"),
    ("Turkey", "Ankara"),
    ("Uganda", "Kampala"),
    ("Ukraine", "Kyiv"),
    ("United Kingdom", "London"),
    ("United States", "Washington"),
    ("Uruguay", "Montevideo"),
    ("Venezuela", "Caracas"),
    ("Vietnam", "Hanoi"),
    ("Zambia", "Lusaka"),
    ("Zimbabwe", "Harare"),
)

QUESTIONS = (
    "What is the capital of {country}?",
    "Which city is the capital of {country}?",
    "Tell me the capital city of {country}.",
)
ANSWER = "The capital of {country} is {capital}."
SYSTEM = "You are a geography assistant. Answer in one sentence."


def demo_conversations(seed: int = 0) -> list[list[dict[str, str]]]:
    """Every demo conversation, in a fixed shuffled order."""
    rng = random.Random(seed)
    rows = []
    for country, capital in COUNTRIES:
        for question in QUESTIONS:
            messages = []
            if rng.random() < 0.25:
                messages.append({"role": "system", "content": SYSTEM})
            messages.append({"role": "user", "content": question.format(country=country)})
            messages.append({"role": "assistant", "content": ANSWER.format(country=country, capital=capital)})
            rows.append(messages)
    rng.shuffle(rows)
    return rows


def demo_dataset_jsonl() -> bytes:
    """The demo dataset as chat JSONL (one ``{"messages": [...]}`` per line), ~330 rows."""
    lines = [json.dumps({"messages": m}, ensure_ascii=False) for m in demo_conversations()]
    return ("\n".join(lines) + "\n").encode("utf-8")
