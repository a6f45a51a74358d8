"""The words blackbox writes its documents in.

Plain lower-case English, space-separated, punctuation as separate words, so any tokenizer handles it and the
tiny CPU model's word-level tokenizer (which includes every word here) round-trips it exactly.
"""

from __future__ import annotations

__all__ = ["CODE_WORDS", "FILLER", "NAMES", "PUNCTUATION", "TEMPLATE_WORDS", "WORDS"]

PUNCTUATION: tuple[str, ...] = (".", ",", ":", "?", "!", ";", "-")

# Words that only appear in needle codes, so a recalled code cannot come from the filler.
CODE_WORDS: tuple[str, ...] = tuple(
    """zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty alpha
    bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec
    romeo sierra tango uniform victor whiskey xray yankee zulu""".split()
)

NAMES: tuple[str, ...] = tuple(
    """amber birch cedar dune ember fern granite harbor iris jasper kestrel lotus maple nectar onyx pebble
    quartz raven saffron thistle umber violet willow yarrow zephyr aspen basil clover dahlia elm flint
    garnet hazel indigo juniper kelp laurel marigold nutmeg olive poppy reed sage tansy sorrel teal
    walnut""".split()
)

TEMPLATE_WORDS: tuple[str, ...] = tuple(
    """the code of is read record and remember every now write a long story about what answer with only
    question keep in mind following these are codes for each name""".split()
)

FILLER: tuple[str, ...] = tuple(
    """river mountain village market winter summer morning evening garden window bridge forest lantern
    harvest meadow castle valley ocean island desert cloud storm thunder candle mirror letter journey
    captain farmer teacher painter sailor miller baker weaver hunter stranger child mother father sister
    brother friend neighbor king queen knight merchant traveler walked carried found built opened closed
    watched followed painted gathered counted remembered forgot noticed whispered shouted waited
    returned crossed climbed planted old young quiet bright dark cold warm gentle heavy narrow wide
    green golden silver red blue small large early late slowly quickly softly carefully often never
    always sometimes under over near beside behind across through toward after before during while
    because then there here when where which who that this those many few some all every no house road
    stone wall door field tree flower bird horse boat ship wagon wheel rope basket bread water fire
    light shadow song story book map key coin ring cup bowl he she they we it his her their our was were
    had has will would could should to from with without into onto upon at by on in for as but or if so
    not day night year hour season week month time way place side end part""".split()
)

WORDS: tuple[str, ...] = tuple(dict.fromkeys(PUNCTUATION + CODE_WORDS + NAMES + TEMPLATE_WORDS + FILLER))
