"""Planning a load: which holder block serves each token of a hit, and the byte runs that move
them: byte for byte between equal layouts (peer_plan), or through staging and a native scatter
where block size, byte format or TP head split differ (convert).
"""
