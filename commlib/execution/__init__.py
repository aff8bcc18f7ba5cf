"""How a group's collectives run: one order on every rank (:mod:`.executor`), the handle of an
asynchronous one (:mod:`.work`), and the debug fingerprints that check every rank calls the same
one (:mod:`.fingerprint`)."""
