"""Ordinary English prompts used to measure (and re-check, from Rust) the built-in model's routing skew.

Written for this project (Apache-2.0). Imported by scripts/make_builtin_model.py and copied verbatim
into models/builtin/skew.json, which is what the Rust tests read.
"""

PROMPTS = [
    "To make a simple tomato soup, soften an onion and two cloves of garlic in olive oil, add a tin of "
    "chopped tomatoes and a cup of stock, simmer for twenty minutes, then blend until smooth and season "
    "with salt, pepper and a little sugar.",

    "The storm moved in from the west late on Tuesday afternoon. Within an hour the temperature had "
    "dropped by ten degrees, the wind was bending the trees along the river, and heavy rain flooded "
    "several roads near the old market.",

    "In the early nineteenth century the first public railways carried coal from the mines to the "
    "harbours. Within a few decades trains were moving passengers between the great cities, and the "
    "idea of a standard time across a whole country began to make sense.",

    "Jupiter is the largest planet in our solar system. It is a gas giant made mostly of hydrogen and "
    "helium, and its famous Great Red Spot is a storm that has been raging for hundreds of years.",

    "If you want tomatoes in the summer, start the seeds indoors about six weeks before the last frost. "
    "Keep the young plants in a sunny window, water them gently, and move them outside once the nights "
    "are warm.",

    "The home team scored twice in the final ten minutes to win the match three goals to two. Their "
    "coach said after the game that the players never stopped believing, even when they were behind.",

    "Dear Anna, thank you for your letter. We arrived in the mountains on Friday and the weather has "
    "been wonderful. Tomorrow we plan to walk to the lake and have lunch by the water. I will write "
    "again soon.",

    "A budget is a plan for your money. Write down what you earn each month, list your regular costs "
    "such as rent, food and travel, and decide how much you can save before you spend anything on "
    "extras.",

    "Please write a short Python function that reads a text file, counts how many times each word "
    "appears, and returns the ten most common words together with their counts.",

    "Regular exercise, a balanced diet and enough sleep are the foundations of good health. Even a "
    "brisk walk of thirty minutes a day can lower blood pressure and improve your mood.",

    # long prompt (several paragraphs)
    "The small town of Westbridge sits where two rivers meet, and for most of its history the life of "
    "the town has followed the water. In the spring, when the snow melts in the hills, the rivers rise "
    "and the fields along the banks turn into shallow lakes. Farmers learned long ago to plant late and "
    "to build their barns on higher ground. In the summer the water is low and clear, children swim "
    "near the old stone bridge, and visitors come to fish, walk and sit in the cafes along the quay.\n\n"
    "The bridge itself is the oldest building in the town. It was built in the fourteenth century by "
    "monks from the abbey on the hill, who charged a small toll to every cart that crossed. The abbey "
    "is now a ruin, but the bridge still carries traffic every day, although heavy lorries have not "
    "been allowed to use it since a crack appeared in one of the arches after the great flood of 1947. "
    "Engineers repaired the arch with the same kind of stone and the town celebrated with a market "
    "that is still held every year on the first Saturday of June.\n\n"
    "In the nineteenth century Westbridge grew quickly. A canal was cut to link the rivers with the "
    "coast, and mills were built to spin wool and later cotton. Rows of brick houses went up for the "
    "workers, along with chapels, schools and a library paid for by one of the mill owners. When the "
    "railway arrived in 1862 the canal began to decline, and by the end of the century most of the "
    "boats had gone. The mills kept working until the 1960s, when cheaper cloth from abroad made them "
    "too expensive to run.\n\n"
    "Today the largest mill has been turned into flats, offices and a museum that tells the story of "
    "the town. Visitors can see the great steam engine that once drove the looms, read letters written "
    "by the workers, and try their hand at spinning. The canal has been cleaned and restored, and "
    "narrow boats now carry tourists slowly through the green countryside, past locks, farms and "
    "small villages.\n\n"
    "People who live in Westbridge say that the best time to visit is early autumn. The crowds of "
    "summer have gone, the trees along the rivers turn red and gold, and the morning mist lies over "
    "the water until the sun is high. The bakery on the market square sells apple cakes made from "
    "fruit grown in the valley, and in the evening the pubs by the bridge are full of walkers telling "
    "each other about the hills they have climbed. It is a quiet place, but one that rewards anyone "
    "who takes the time to look closely at its streets, its water and its long history.",
]

# Indices (into PROMPTS) whose reference logits go into models/tests/fixtures/builtin_reference.safetensors,
# in order of preference; the generator takes the first two whose routing has no near-tie.
REFERENCE_CANDIDATES = [3, 9, 0, 1, 5, 7, 2, 4, 6, 8]
