// Workgroup-wide sum over WG invocations through shared memory (one row per workgroup).
// The including kernel declares `layout(constant_id = ...) const int WG` first.
shared float s_red[WG];

float block_sum(float v) {
    uint tid = gl_LocalInvocationID.x;
    s_red[tid] = v;
    barrier();
    for (uint s = uint(WG) / 2u; s > 0u; s >>= 1) {
        if (tid < s) s_red[tid] += s_red[tid + s];
        barrier();
    }
    float r = s_red[0];
    barrier();
    return r;
}

float block_max(float v) {
    uint tid = gl_LocalInvocationID.x;
    s_red[tid] = v;
    barrier();
    for (uint s = uint(WG) / 2u; s > 0u; s >>= 1) {
        if (tid < s) s_red[tid] = max(s_red[tid], s_red[tid + s]);
        barrier();
    }
    float r = s_red[0];
    barrier();
    return r;
}
