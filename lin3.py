import numpy as np, itertools
b=0.9
def mat(a, al, l1, l2):
    # state [x_t, x_{t-1}, m_{t-1}, m_{t-2}, g_{t-1}, g_{t-2}]
    def step(s):
        x, x1, m1, m2, gp, gpp = s
        w = x1 - al*m2
        g = a*w
        gc = g + l1*(g-gp) + l2*(gp-gpp)
        m = b*m1 + (1-b)*gc
        return np.array([x - m, x, m, m1, g, gp])
    return np.stack([step(e) for e in np.eye(6)], 1)
def amax(*k):
    for a in np.concatenate([np.arange(0.05, 10, 0.05), np.arange(10,40,0.5)]):
        if max(abs(np.linalg.eigvals(mat(a,*k)))) > 1+1e-9: return round(a,2)
    return 40
best=[]
for al in [0,0.5,1,1.5,2]:
    for l1 in [0,0.25,0.5,0.75,1,1.5]:
        for l2 in [-0.5,-0.25,0,0.25,0.5]:
            best.append((amax(al,l1,l2),al,l1,l2))
best.sort(reverse=True); print(best[:12])
