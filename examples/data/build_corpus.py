"""Regenerate corpus.txt, the bundled training text for examples/gpt.py.

The passages below are public domain: US founding documents, Lincoln, the King James
Bible, Shakespeare, and the openings of a few nineteenth-century novels and poems. The
Aesop fables are retold here in plain words (the stories themselves are public domain).
The corpus is these passages in a seeded shuffle, repeated until it reaches TARGET_BYTES,
so the file is byte-for-byte reproducible:

    python examples/data/build_corpus.py
"""

from __future__ import annotations

import random
from pathlib import Path

TARGET_BYTES = 300_000
SEED = 1863

PASSAGES = [
    # Gettysburg Address (Bliss copy), Abraham Lincoln, 1863.
    """Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, and dedicated to the proposition that all men are created equal.""",
    """Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final resting place for those who here gave their lives that that nation might live. It is altogether fitting and proper that we should do this.""",
    """But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add or detract. The world will little note, nor long remember what we say here, but it can never forget what they did here. It is for us the living, rather, to be dedicated here to the unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to be here dedicated to the great task remaining before us -- that from these honored dead we take increased devotion to that cause for which they gave the last full measure of devotion -- that we here highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new birth of freedom -- and that government of the people, by the people, for the people, shall not perish from the earth.""",
    # Second Inaugural Address, closing, Abraham Lincoln, 1865.
    """With malice toward none, with charity for all, with firmness in the right, as God gives us to see the right, let us strive on to finish the work we are in, to bind up the nation's wounds, to care for him who shall have borne the battle and for his widow and his orphan, to do all which may achieve and cherish a just and lasting peace among ourselves and with all nations.""",
    # Declaration of Independence, 1776.
    """When in the Course of human events, it becomes necessary for one people to dissolve the political bands which have connected them with another, and to assume among the powers of the earth, the separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind requires that they should declare the causes which impel them to the separation.""",
    """We hold these truths to be self-evident, that all men are created equal, that they are endowed by their Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving their just powers from the consent of the governed, That whenever any Form of Government becomes destructive of these ends, it is the Right of the People to alter or to abolish it, and to institute new Government, laying its foundation on such principles and organizing its powers in such form, as to them shall seem most likely to effect their Safety and Happiness.""",
    """Prudence, indeed, will dictate that Governments long established should not be changed for light and transient causes; and accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils are sufferable, than to right themselves by abolishing the forms to which they are accustomed. But when a long train of abuses and usurpations, pursuing invariably the same Object evinces a design to reduce them under absolute Despotism, it is their right, it is their duty, to throw off such Government, and to provide new Guards for their future security.""",
    """We, therefore, the Representatives of the united States of America, in General Congress, Assembled, appealing to the Supreme Judge of the world for the rectitude of our intentions, do, in the Name, and by Authority of the good People of these Colonies, solemnly publish and declare, That these United Colonies are, and of Right ought to be Free and Independent States; that they are Absolved from all Allegiance to the British Crown, and that all political connection between them and the State of Great Britain, is and ought to be totally dissolved; and that as Free and Independent States, they have full Power to levy War, conclude Peace, contract Alliances, establish Commerce, and to do all other Acts and Things which Independent States may of right do. And for the support of this Declaration, with a firm reliance on the protection of divine Providence, we mutually pledge to each other our Lives, our Fortunes and our sacred Honor.""",
    # Preamble to the Constitution of the United States, 1787.
    """We the People of the United States, in Order to form a more perfect Union, establish Justice, insure domestic Tranquility, provide for the common defence, promote the general Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, do ordain and establish this Constitution for the United States of America.""",
    # King James Bible: Genesis 1:1-5, Psalm 23, Ecclesiastes 3:1-8.
    """In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God said, Let there be light: and there was light. And God saw the light, that it was good: and God divided the light from the darkness. And God called the light Day, and the darkness he called Night. And the evening and the morning were the first day.""",
    """The LORD is my shepherd; I shall not want.
He maketh me to lie down in green pastures: he leadeth me beside the still waters.
He restoreth my soul: he leadeth me in the paths of righteousness for his name's sake.
Yea, though I walk through the valley of the shadow of death, I will fear no evil: for thou art with me; thy rod and thy staff they comfort me.
Thou preparest a table before me in the presence of mine enemies: thou anointest my head with oil; my cup runneth over.
Surely goodness and mercy shall follow me all the days of my life: and I will dwell in the house of the LORD for ever.""",
    """To every thing there is a season, and a time to every purpose under the heaven:
A time to be born, and a time to die; a time to plant, and a time to pluck up that which is planted;
A time to kill, and a time to heal; a time to break down, and a time to build up;
A time to weep, and a time to laugh; a time to mourn, and a time to dance;
A time to cast away stones, and a time to gather stones together; a time to embrace, and a time to refrain from embracing;
A time to get, and a time to lose; a time to keep, and a time to cast away;
A time to rend, and a time to sew; a time to keep silence, and a time to speak;
A time to love, and a time to hate; a time of war, and a time of peace.""",
    # Shakespeare: Sonnets 18, 29, 55, 73, 116, 130.
    """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall Death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.""",
    """When, in disgrace with fortune and men's eyes,
I all alone beweep my outcast state,
And trouble deaf heaven with my bootless cries,
And look upon myself and curse my fate,
Wishing me like to one more rich in hope,
Featured like him, like him with friends possess'd,
Desiring this man's art and that man's scope,
With what I most enjoy contented least;
Yet in these thoughts myself almost despising,
Haply I think on thee, and then my state,
Like to the lark at break of day arising
From sullen earth, sings hymns at heaven's gate;
For thy sweet love remember'd such wealth brings
That then I scorn to change my state with kings.""",
    """Not marble, nor the gilded monuments
Of princes, shall outlive this powerful rhyme;
But you shall shine more bright in these contents
Than unswept stone, besmear'd with sluttish time.
When wasteful war shall statues overturn,
And broils root out the work of masonry,
Nor Mars his sword nor war's quick fire shall burn
The living record of your memory.
'Gainst death and all-oblivious enmity
Shall you pace forth; your praise shall still find room
Even in the eyes of all posterity
That wear this world out to the ending doom.
So, till the judgment that yourself arise,
You live in this, and dwell in lovers' eyes.""",
    """That time of year thou mayst in me behold
When yellow leaves, or none, or few, do hang
Upon those boughs which shake against the cold,
Bare ruin'd choirs, where late the sweet birds sang.
In me thou see'st the twilight of such day
As after sunset fadeth in the west,
Which by and by black night doth take away,
Death's second self, that seals up all in rest.
In me thou see'st the glowing of such fire
That on the ashes of his youth doth lie,
As the death-bed whereon it must expire,
Consumed with that which it was nourish'd by.
This thou perceiv'st, which makes thy love more strong,
To love that well which thou must leave ere long.""",
    """Let me not to the marriage of true minds
Admit impediments. Love is not love
Which alters when it alteration finds,
Or bends with the remover to remove:
O no! it is an ever-fixed mark
That looks on tempests and is never shaken;
It is the star to every wandering bark,
Whose worth's unknown, although his height be taken.
Love's not Time's fool, though rosy lips and cheeks
Within his bending sickle's compass come:
Love alters not with his brief hours and weeks,
But bears it out even to the edge of doom.
If this be error and upon me proved,
I never writ, nor no man ever loved.""",
    """My mistress' eyes are nothing like the sun;
Coral is far more red than her lips' red;
If snow be white, why then her breasts are dun;
If hairs be wires, black wires grow on her head.
I have seen roses damask'd, red and white,
But no such roses see I in her cheeks;
And in some perfumes is there more delight
Than in the breath that from my mistress reeks.
I love to hear her speak, yet well I know
That music hath a far more pleasing sound;
I grant I never saw a goddess go;
My mistress, when she walks, treads on the ground:
And yet, by heaven, I think my love as rare
As any she belied with false compare.""",
    # Shakespeare: Hamlet III.i, Macbeth V.v, As You Like It II.vii.
    """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die, to sleep,
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to: 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep, perchance to dream: ay, there's the rub:
For in that sleep of death what dreams may come,
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life.""",
    """To-morrow, and to-morrow, and to-morrow,
Creeps in this petty pace from day to day,
To the last syllable of recorded time;
And all our yesterdays have lighted fools
The way to dusty death. Out, out, brief candle!
Life's but a walking shadow, a poor player,
That struts and frets his hour upon the stage,
And then is heard no more. It is a tale
Told by an idiot, full of sound and fury,
Signifying nothing.""",
    """All the world's a stage,
And all the men and women merely players;
They have their exits and their entrances;
And one man in his time plays many parts,
His acts being seven ages.""",
    # Poems: Blake, "The Tyger" (first stanza); Wordsworth, "I Wandered Lonely as a Cloud" (first stanza).
    """Tyger Tyger, burning bright,
In the forests of the night;
What immortal hand or eye,
Could frame thy fearful symmetry?""",
    """I wandered lonely as a cloud
That floats on high o'er vales and hills,
When all at once I saw a crowd,
A host, of golden daffodils;
Beside the lake, beneath the trees,
Fluttering and dancing in the breeze.""",
    # Novel openings: Austen, Dickens, Melville.
    """It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.""",
    """It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the other way.""",
    """Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the world.""",
    # Aesop's fables, retold.
    """THE FOX AND THE GRAPES. A hungry Fox came upon a vine that grew over a high trellis, and the bunches of ripe grapes hung far above his head. He leaped for them again and again, but he could not reach them. At last he turned away and said, with his nose in the air, "I am sure they are sour." It is easy to despise what you cannot get.""",
    """THE TORTOISE AND THE HARE. The Hare laughed at the Tortoise for his short feet and his slow pace, and the Tortoise answered, "I will race you, and I will win." The Hare ran far ahead, and because he was so sure of himself he lay down by the road to sleep. The Tortoise kept on, step by step, and never stopped. When the Hare woke he ran as fast as he could, but the Tortoise had already crossed the line. Slow and steady wins the race.""",
    """THE BOY WHO CRIED WOLF. A Shepherd Boy who watched his flock near a village grew tired of the quiet, and he cried out, "Wolf! Wolf!" The villagers ran to help him and found no wolf, and the boy laughed at them. He played the trick a second time, and again they came. Then one evening a Wolf really came out of the forest. The boy cried, "Wolf! Wolf!" as loud as he could, but no one came, for no one believed him, and the Wolf did as he pleased with the flock. A liar will not be believed, even when he tells the truth.""",
    """THE ANT AND THE GRASSHOPPER. All through the summer the Grasshopper sang in the grass, while the Ant carried grain to his nest. "Why do you work so hard?" asked the Grasshopper. "Come and sing with me." "I am laying up food for the winter," said the Ant, "and you would do well to do the same." When the winter came the Grasshopper had nothing to eat, and he saw the Ant sharing out the grain he had gathered. It is wise to prepare today for the needs of tomorrow.""",
    """THE LION AND THE MOUSE. A Lion was asleep when a little Mouse ran across his face. The Lion woke and caught her under his paw. "Let me go," said the Mouse, "and some day I will repay you." The Lion laughed, but he let her go. Not long after, the Lion was caught in a hunter's net and roared in anger. The Mouse heard him, came running, and gnawed the ropes until the Lion was free. "You laughed at me," she said, "but now you see that even a Mouse can help a Lion." No act of kindness is ever wasted.""",
    """THE CROW AND THE PITCHER. A Crow, half dead with thirst, found a pitcher that had once been full of water, but the water was so low that she could not reach it with her beak. She tried to tip the pitcher over, but it was too heavy. Then she took up a pebble and dropped it into the pitcher, and then another, and another, and with every pebble the water rose a little, until at last it came near enough for her to drink. Little by little does the trick.""",
    """THE NORTH WIND AND THE SUN. The North Wind and the Sun argued about which of them was the stronger, and they agreed that whoever could make a traveller take off his cloak should be called the stronger. The North Wind blew as hard as he could, but the harder he blew, the closer the traveller wrapped his cloak around him. Then the Sun came out and shone warmly, and soon the traveller grew so hot that he took off his cloak and sat down in the shade. Gentleness often does what force cannot.""",
    """THE TOWN MOUSE AND THE COUNTRY MOUSE. A Country Mouse invited his cousin from the town to dinner, and gave him beans and bacon and bread. The Town Mouse said, "How can you bear such plain food? Come with me and I will show you how to live." So they went to the town, and in a great dining room they found the remains of a feast. But they had hardly begun to eat when the door opened and two large dogs ran in, and the mice fled for their lives. "Good-bye, cousin," said the Country Mouse. "Better beans and bacon in peace than cakes and ale in fear.\"""",
    """THE DOG AND HIS REFLECTION. A Dog was carrying a piece of meat home in his mouth, and as he crossed a bridge over a stream he looked down and saw his own reflection in the water. He thought it was another dog with a larger piece of meat, and he snapped at it to take it. As he opened his mouth his own meat fell into the water and was carried away. Grasp at the shadow and you may lose the substance.""",
    """THE GOOSE THAT LAID THE GOLDEN EGGS. A farmer and his wife owned a Goose that laid a golden egg every day. They grew rich, but they were not content, and they said to each other, "If the Goose lays golden eggs, she must be full of gold inside." So they killed her and cut her open, and found that she was just like any other goose. They had no more golden eggs. Greed often destroys the very thing it feeds on.""",
    """THE FOX AND THE CROW. A Crow sat on the branch of a tree with a piece of cheese in her beak. A Fox saw her and wanted the cheese. "What a fine bird you are," he said. "Your feathers are so bright, and surely your voice is the sweetest in the forest. Will you not sing for me?" The Crow was so pleased that she opened her beak to sing, and the cheese fell to the ground, where the Fox snapped it up. "Thank you," said the Fox. "Do not trust flatterers.\"""",
    """THE WOLF IN SHEEP'S CLOTHING. A Wolf found the skin of a sheep and wrapped himself in it, and in this disguise he walked among the flock, and the shepherd did not know him. That night the shepherd, wanting meat for his supper, went into the fold in the dark and took the first animal he laid his hand on, and it was the Wolf. Appearances are deceptive.""",
]


def build() -> str:
    rng = random.Random(SEED)
    parts: list[str] = []
    size = 0
    while size < TARGET_BYTES:
        order = list(PASSAGES)
        rng.shuffle(order)
        for p in order:
            parts.append(p)
            size += len(p) + 2
    return "\n\n".join(parts) + "\n"


def main() -> None:
    text = build()
    assert text.isascii()
    out = Path(__file__).with_name("corpus.txt")
    out.write_text(text, encoding="ascii", newline="\n")
    print(f"wrote {out} ({len(text.encode())} bytes, {len(set(text))} distinct chars)")


if __name__ == "__main__":
    main()
