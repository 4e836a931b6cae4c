"""Short descriptions of what an image may show, the pool heads are described from
(text/heads.py), in the spirit of TextSpan's (Gandelsman et al. 2024): colours, textures, shapes,
places, things, living beings, counts, styles and light, each a phrase a CLIP model reads as an
image caption."""

DESCRIPTIONS = (
    # colours
    "a red object", "a green object", "a blue object", "a yellow object", "an orange object",
    "a purple object", "a pink object", "a brown object", "a black object", "a white object",
    "a grey object", "bright colours", "pastel colours", "a black and white photo", "a colourful pattern",
    # textures and materials
    "a furry texture", "a smooth surface", "a rough texture", "a wooden surface", "a metal surface",
    "glass", "water", "sand", "grass", "leaves", "stone", "fabric", "feathers", "scales", "snow",
    "a striped pattern", "a spotted pattern", "a checkered pattern", "a shiny reflection", "a blurry background",
    # shapes and geometry
    "a circle", "a square", "a triangle", "a straight line", "a curve", "a grid", "a spiral",
    "a symmetric shape", "a small object", "a large object", "a close-up", "a wide view", "an object in the centre",
    "an object at the edge of the image", "many small things", "a single object", "empty space",
    # places and scenes
    "a beach", "a forest", "a city street", "a kitchen", "a living room", "an office", "a mountain",
    "a lake", "the sky", "a sunset", "a night scene", "a field", "a road", "a garden", "a desert",
    "an underwater scene", "a snowy landscape", "indoors", "outdoors", "a building", "a bridge",
    # things
    "a car", "a bicycle", "a boat", "an airplane", "a train", "a chair", "a table", "a bed", "a lamp",
    "a cup", "a bottle", "a plate of food", "a fruit", "a flower", "a tree", "a book", "a phone",
    "a computer", "a clock", "a toy", "a ball", "a hat", "shoes", "a bag", "a sign with text",
    "letters and words", "numbers", "a logo",
    # living beings
    "a dog", "a cat", "a bird", "a fish", "a horse", "an insect", "a cow", "a wild animal",
    "a person", "a face", "a child", "a group of people", "hands", "eyes", "a smiling person",
    "an animal's head", "an animal's legs", "a tail", "fur",
    # counts and layout
    "one thing", "two things", "three things", "a crowd", "a pair", "a row of objects",
    "objects stacked on each other", "something on the left", "something on the right",
    "something at the top", "something at the bottom",
    # styles, light and mood
    "a photograph", "a painting", "a drawing", "a cartoon", "a sketch", "a 3D render", "a screenshot",
    "a vintage photo", "a bright sunny day", "a dark scene", "soft light", "a shadow", "a reflection",
    "a happy mood", "a calm scene", "motion", "a blurry photo", "a sharp photo", "a framed picture",
)
