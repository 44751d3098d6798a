"""English stop words that augmentation never replaces (kdrun's own list; no NLTK data needed).

Function words (articles, pronouns, auxiliaries, prepositions, conjunctions, common adverbs and
quantifiers) plus the fragments that contractions split into once punctuation is separated:
``doesn't`` -> ``doesn ' t`` and the PTB-style ``does n't`` -> ``does n ' t`` (``n``, ``t``, ``s``,
``ll``, ``ve``, ``re``, ``d``, ``m``, ``em`` ...). Comparison is on the lower-cased word.
"""

from __future__ import annotations

_ARTICLES_AND_DETERMINERS = """
a an the this that these those each every either neither another such what which whose whatever
whichever some any no all both few many much more most other several own same
"""

_PRONOUNS = """
i me my mine myself we us our ours ourselves you your yours yourself yourselves he him his himself
she her hers herself it its itself they them their theirs themselves who whom whoever one ones
"""

_AUXILIARIES = """
am is are was were be been being have has had having do does did doing will would shall should can
could may might must ought
"""

_PREPOSITIONS = """
about above across after against along among around at before behind below beneath beside besides
between beyond by down during except for from in inside into near of off on onto out outside over
past per since through throughout till to toward towards under underneath until up upon via with
within without
"""

_CONJUNCTIONS_AND_ADVERBS = """
and but or nor so yet if then else than because as while whereas although though unless whether
once when whenever where wherever why how here there now just only also too very not again further
ever even still already soon rather quite
"""

# What contractions leave behind after splitting at the apostrophe.
_CONTRACTION_FRAGMENTS = """
s t d ll m o re ve y n em
ain aren couldn didn doesn don hadn hasn haven isn ma mightn mustn needn shan shouldn wasn weren won
wouldn
"""

STOP_WORDS: frozenset[str] = frozenset(
    " ".join(
        (
            _ARTICLES_AND_DETERMINERS,
            _PRONOUNS,
            _AUXILIARIES,
            _PREPOSITIONS,
            _CONJUNCTIONS_AND_ADVERBS,
            _CONTRACTION_FRAGMENTS,
        )
    ).split()
)
