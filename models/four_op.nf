# The seed's four-op graph: padding, dilated conv, depth-to-space, concatenation.
A = tensor([1, 3, 224, 224])
B = tensor([1, 3, 228, 228])
C = tensor([64, 3, 3, 3])
D = tensor([1, 64, 112, 112])
E = tensor([1, 16, 224, 224])
F = tensor([1, 19, 224, 224])

B[n, c, h, w] = Select(
    h>2 && h<226 && w>2 && w<226,
    A[n, c, h-2, w-2], 0)
D[n, k, p, q] = ReduceAdd({r, s},
    B[n, c, p*2+r*2, q*2+s*2]
    * C[k, c, r, s])
E[n, c, h, w] = D[n, c*4+h%2*2+w%2, h//2, w//2]
F[n, c, h, w] = Select(c<3,
    A[n, c, h, w], E[n, c-3, h, w])
