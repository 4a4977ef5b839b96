"""Choose the kernel family, layout, math and tiles for a call.

Heuristics (CUDA), tried in order; the first family whose `check` accepts the spec wins:

1. depthwise: groups == in_channels (any channel multiplier), NCHW. A bandwidth-bound
   stencil; the tensor-core GEMMs would run at K = kh*kw, far too thin to pay.
   depthwise_nhwc: the same in channels_last, vectorised along channels (up to 9x9 kernels).
   H100, batch 32, ms (depthwise_nhwc / direct, which served these before / F.conv2d):
   MobileNetV2's 32 channels 3x3 on 112 x 112 float32 0.056 / 0.332 / 0.052, bf16 0.042 /
   0.248 / 0.039; 144 on 56 x 56 float32 0.062 / 0.428 / 0.058; ConvNeXt's 96 channels 7x7
   on 56 x 56 float32 0.090 / 0.372 / 0.19, bf16 0.097 / 0.342 / 0.083.
   grouped_nhwc: channels_last grouped layers of 2-16 input channels a group, on the same
   kernel (a thread's outputs read their groups' run of input channels, float32 FMAs), where
   it beats nhwc's tensor cores: up to 8 channels a group; past 8 only for strict float32
   (nhwc's 3xTF32) or channels nhwc cannot take (not whole 16-byte chunks). H100, batch 32,
   channels_last input and weights, ms (grouped_nhwc / nhwc or direct, which served these
   before / F.conv2d): ResNeXt-50's 32 groups of 4 on 56 x 56 TF32 0.081 / 0.403 / 0.101, bf16
   0.064 / 0.071 (direct) / 0.064; of 8 on 28 x 28 TF32 0.073 / 0.109 / 0.058, bf16 0.055 /
   0.107 / 0.044; of 16 on 14 x 14 (grouped_mma's since, below; 4 x 1 tiles) TF32 0.067 / 0.063 /
   0.041, bf16 0.059 / 0.053 / 0.032, strict 0.067 (FMAs are exact) / 0.097 (3xTF32) / 0.257.
   NCHW grouped layers go there too (the input transposed into the workspace, the output written
   to NCHW), against igemm's thin reduction on tensor cores: up to 8 channels a group, 16 in
   strict float32. H100, batch 32, same process, three rounds (five for the second 28 x 28), ms
   (grouped_nhwc / igemm / F.conv2d), TF32, strict, bf16: groups of 4 on 56 x 56 0.112 / 0.220 /
   0.176, 0.116 / 0.300 / 0.485, 0.102 / 0.223 / 0.131; of 8 on 28 x 28 0.094 / 0.122 / 0.104,
   0.097 / 0.141 / 0.274, 0.077 / 0.107 / 0.078; of 8 at stride 2 from 56 x 56 0.191 / 0.239 /
   0.171, 0.189 / 0.243 / 0.241, 0.146 / 0.161 / 0.127; of 16 on 14 x 14 strict 0.092 / 0.102 /
   0.269, but TF32 0.094 / 0.085 and bf16 0.088 / 0.070 (grouped_mma's since, as are TF32 groups
   of 8, below). Runs of 2 pixels
   (vec_q 2, which divides 14) lost to 4 on every such layer. NCHW depthwise stays on `depthwise` (depthwise_nhwc
   through the transpose: 960 channels on 7 x 7 0.052 / 0.044, 384 on 14 x 14 0.078 / 0.036),
   except input planes of at most SMALL_PLANE elements: depthwise_planes stages whole planes a
   block, one contiguous run of them. H100, batch 32, 3x3 padding 1, same process, stream time of
   20 calls, us (depthwise_planes' default tiles / depthwise / F.conv2d): 960 channels on 7 x 7
   float32 11.5 / 25.6 / 16.0, bf16 11.5 / 26.6 / 17.1; 576 on 14 x 14 stride 2 float32 10.4 (16
   planes) / 21.1 / 11.0; 384 on 14 x 14 float32 13.8 (16 planes) / 18.5 / 23.0, bf16 14.4 / 19.1 /
   24.6. On 28 x 28 depthwise wins in float32 (192 channels 23.6 / 17.8; bf16 24.2 / 26.2), and on
   56 x 56 by more (144 channels float32 69.3 / 46.6).
   grouped_mma: grouped layers of wider groups on tensor cores (a block's window of GB groups
   staged once, a warp's taps in registers; TF32 and 16-bit): channels_last groups of 16 input
   channels (bf16's one MMA k-step, TF32's two), and NCHW groups of up to 32 (the input read in
   place since, or through its transpose: grouped_mma.py), where igemm ran them, and NCHW TF32
   groups of 8, where grouped_nhwc did. Through the transpose (fortieth session), H100,
   ResNeXt-50's 32 groups at batch 32, 3x3, same process, stream time of 20 calls, us
   (grouped_mma / what served them before / F.conv2d): of 16 on
   14 x 14 channels_last bf16 11.6 / 24.4 (nhwc) / 25.3, TF32 24.0 / 37.1 / 35.8; NCHW bf16 33.5 /
   51.6 (igemm) / 44.1; of 16 at stride 2 from 28 x 28 channels_last bf16 20.3 / 28.2 / 25.8, TF32
   47.2 / 46.9 / 43.8, NCHW bf16 64.0 / 74.9 / 68.0, TF32 102.4 / 369.6 / 96.6; of 32 on 7 x 7
   NCHW bf16 31.7 / 46.0 / 34.6, TF32 46.6 / 73.6 / 41.8, at stride 2 from 14 x 14 bf16 39.6 /
   75.5 / 43.9, TF32 76.5 / 185.7 / 60.6. Channels_last groups of 32 stay on nhwc (7 x 7 bf16
   13.5 against 15.9-20.2, TF32 31.0 against 34.2), as do groups of 8 on grouped_nhwc (TF32 on
   28 x 28 41.7 against 39.5-41.0; 39.6 against 41.7 in a later run, a tie kept).
   NCHW read in place (forty-second session), same process, stream us (grouped_mma / F.conv2d):
   of 16 on 14 x 14 TF32 33.1 / 63.0 (54.0 through the transpose), bf16 23.6 / 44.6 (33.5); of 32 on
   7 x 7 TF32 41.5 / 42.6 (47.2), bf16 27.1 / 33.7 (31.1); of 16 at stride 2 from 28 x 28 TF32 70.0 /
   95.8 (89.1); of 8 on 28 x 28 TF32 50.0 / 106.8 against grouped_nhwc's 68.2, and at stride 2 from
   56 x 56 112.5 / 172.5 against 163.6.
   stem_nhwc: channels_last dense layers of 2-4 input channels (first layers: RGB, RGBA; one is
   depthwise's), and of
   5-8 where nhwc cannot take them (not whole 16-byte chunks: direct served them) or, 16-bit only,
   with 7x7 kernels or larger: one implicit GEMM whose reduction packs every tap and channel, its
   A operand read from the input rows the block's windows span, staged once. nhwc reads one
   tap's channels a k-tile row, which 3 channels cannot fill, and 4 fill an eighth of. H100, same
   process, three rounds, ms (stem_nhwc / F.conv2d), TF32, strict, bf16: ResNet's 3->64 7x7 stride
   2 on 32 x 224 x 224 0.147 / 0.247, 0.286 / 0.426, 0.131 / 0.276; MobileNetV2's 3->32 3x3 stride
   2 0.075 / 0.075, 0.101 / 0.085, 0.052 / 0.078; 3->64 3x3 on 16 x 224 x 224 0.137 / 0.145, 0.183 /
   0.263, 0.091 / 0.156 (direct, which served them, took 0.830-0.877 on the 7x7 and the stride-1
   3x3 and 0.229-0.264 on the stride-2 3x3 in an earlier call). Against the default before (ms,
   stem_nhwc / it / F.conv2d): 4->64 3x3 0.132 / 0.248 (nhwc_tma) / 0.174, 0.217 / 0.405 (nhwc) /
   0.283, 0.097 / 0.870 (direct) / 0.153; 4->64 7x7 stride 2 0.167 / 0.602 / 0.207, 0.354 / 0.540 /
   0.559, 0.136 / 1.111 / 0.248; 4->32 3x3 stride 2 0.072 / 0.087 / 0.093, 0.118 / 0.128 / 0.094,
   0.071 / 0.226 / 0.117. Eight channels stay on nhwc_tma and nhwc (8->64 3x3 TF32 0.184 / 0.242
   but strict 0.329 / 0.267, bf16 0.128 / 0.119; 7x7 stride 2 TF32 0.596 / 0.509, strict 1.02 /
   0.546), except bf16 7x7 (0.269 / 0.625).
2. pointwise_tma (sm_90a): NCHW 1x1 layers at stride 1 without padding, TF32 and 16-bit, from 96
   input channels or more into 64 or more, on planes the TMA can address (whole 16-byte chunks of
   pixels): the input read where it lies by the TMA, wgmma's A fragments (pixels x channels) loaded
   from its boxes by the consumers, the output written straight to NCHW. The families it replaced
   transpose the input first (nhwc) or run mma.sync over per-thread copies (pointwise, wgmma's
   halo tiles), whose loop overhead grows with the reduction. H100, same process, three rounds,
   ms (pointwise_tma / the family it replaced / F.conv2d), TF32 then bf16: 96->96 on 32 x 56 x 56
   0.066 / 0.085 (pointwise) / 0.058 and 0.053 / 0.068 / 0.050; 128->128 0.069 / 0.104 / 0.063 and
   0.064 / 0.102 / 0.058; 128->512 0.145 / 0.227 (wgmma) / 0.150 and 0.091 / 0.138 / 0.086; on 32 x
   28 x 28 0.061 / 0.076 (nhwc) / 0.065 and 0.075 / 0.088 / 0.073; 192->64 0.029 / 0.061 (nhwc) and
   0.050 / 0.056 / 0.045; 256->64 on 32 x 56 x 56 0.083 / 0.104 / 0.083 and 0.062 / 0.090 / 0.055;
   512->128 on 32 x 28 x 28 0.073 / 0.083 / 0.066 and 0.037 / 0.069 / 0.030; 1024->256 on 8 x 64 x
   64 0.115 / 0.234 / 0.132 and 0.072 / 0.185 (nhwc) / 0.060; 1024->1024 0.301 / 0.651 (nhwc) /
   0.258 and 0.175 / 0.372 / 0.134; 256->1024 on 32 x 14 x 14 TF32 0.061 / 0.072 (nhwc) / 0.056.
   Shorter reductions go there only on output planes under POINTWISE_LARGE_PLANE (4096 pixels),
   where pointwise's 16-warp tiles do not apply, and only where their channels fill at least
   three quarters of the first k-tile of 128 bytes (24 float32 channels, 48 16-bit). H100, batch
   32, same process, stream time of 20 calls, us (pointwise_tma / pointwise / F.conv2d): 64->64 on
   56 x 56 TF32 22.8 / 22.9 / 23.4, bf16 7.9 / 11.5 / 8.3; 64->256 TF32 57.1 / 70.3 / 54.8, bf16
   27.8 / 36.8 / 26.7; 24->144 TF32 33.4 / 47.3 / 32.9, but bf16 (three eighths of a k-tile) 30.2
   / 26.2 / 48.4. Case 87's planes stay on pointwise (TF32 4.85 / 4.83 ms, bf16 2.55 / 2.41), as do
   outputs under a wgmma N (144->24 TF32 0.068 / 0.060 ms; stream 31.9 / 31.7 us).
   Except on GPUs of the wide-DRAM class (kernelgen.arch.wide_dram: Hopper parts of more than
   90 GiB, 3.9-4.9 TB/s), where large planes take pointwise_tma too: pointwise's mma.sync tiles
   issue case 87 in 4.7-4.8 ms whatever the bandwidth, which an H100's 3.35 TB/s hides and an
   H200's 4.8 does not. Case 87, stream time of 20 calls, us, same process (pointwise /
   pointwise_tma / F.conv2d): H200 TF32 4780 / 3427 / 3525, bf16 1966 / 1847 / 1813 (its
   movement alone: 3354 and 1678); H100 TF32 4667 / 4717 / 4596, bf16 2341 / 2452 / 2444.
3. nhwc_tma (sm_90a): dense channels_last layers in TF32 and 16-bit whose reduction is 4
   k-tiles (of 128 bytes of one tap's channels) or more, and in TF32 only where the tap windows
   read each input element 4 times or more (kh*kw >= 4*sh*sw), since TF32 pays a rounded copy of
   the whole input: the implicit GEMM of nhwc with the output channels as wgmma's M, its input
   gathered by the TMA's im2col mode and handed over by mbarriers. H100, batch 32 unless named,
   same process, ms (nhwc_tma / nhwc / F.conv2d), TF32 then bf16: VGG's 64->64 3x3 on 8 x 224 x
   224 0.275 / 0.348 / 0.178 and 0.123 / 0.180 / 0.107; 64->64 3x3 on 4 x 256 x 256 0.184 / 0.224
   / 0.122 and 0.084 / 0.109 / 0.076; 64->64 3x3 on 56 x 56 0.087 / 0.101 / 0.073 and 0.047 /
   0.054 / 0.052; 256->256 3x3 on 8 x 56 x 56 0.148 / 0.199 / 0.163 and 0.080 / 0.105 / 0.073; on
   14 x 14 0.061 / 0.078 / 0.057 and 0.039 / 0.049 / 0.045; 512->512 3x3 on 7 x 7 0.089 / 0.103 /
   0.063 and 0.055 / 0.063 / 0.046; 128->128 3x3 stride 2 bf16 0.041 / 0.049 / 0.048 (TF32, 2.25
   reads: 0.101 / 0.097); 256->1024 1x1 on 14 x 14 bf16 0.033 / 0.037 (TF32, one read: 0.049 /
   0.053). Shorter reductions lose: 64->256 1x1 on 56 x 56 (one k-tile in bf16) 0.069 / 0.063, and
   so does TF32 over strided or 1x1 windows: 256->512 1x1 stride 2 0.144 / 0.082. (Its TF32
   tiles of 64 output channels have since rounded in shared memory instead of copying: 64->64
   3x3 on 8 x 224 x 224 0.227 against the copy's 0.278; nhwc_tma.py.)
   TF32 channels_last layers of more than 64 output channels take its a_regs tiles, whatever their
   window or reduction: the GEMM turned round (pixels as wgmma's M), each consumer loading and
   rounding its A fragments in registers, so there is no rounded copy; persistent blocks of 128
   pixels (one block a tile of 64 where 128-pixel tiles would number under 66). H100, batch 32
   unless named, same process, five rounds, ms (a_regs / the default before / F.conv2d): 1x1 64->256 on 56 x 56
   0.087 / 0.097 (nhwc) / 0.087; 256->64 0.083 / 0.087 / 0.072; 24->144 0.055 / 0.064 / 0.053;
   512->128 on 28 x 28 0.066 / 0.068 / 0.061; 256->1024 on 14 x 14 0.053 / 0.063 / 0.050; 2048->512
   on 7 x 7 (64 pixels) 0.049 / 0.066 / 0.037; stride 2 256->512 from 56 x 56 0.065 / 0.082 / 0.054,
   512->1024 from 28 x 28 0.056 / 0.075 / 0.045; 3x3 stride 2 128->128 from 56 x 56 0.072 / 0.099 /
   0.062, 64->64 from 112 x 112 0.091 / 0.114 / 0.082, 256->256 from 28 x 28 0.062 / 0.093 / 0.057;
   3x3 128->128 on 28 x 28 0.062 / 0.065 (nhwc_tma, rounded copy) / 0.057; 256->256 on 14 x 14
   0.059 / 0.063 / 0.056, on 8 x 56 x 56 0.132 / 0.143 / 0.157; 512->512 on 16 x 14 x 14 0.098 /
   0.111 / 0.080, on 7 x 7 (64 pixels) 0.082 / 0.098 / 0.064. Not at 64 output channels or fewer
   (1x1 64->64 0.066 / 0.063 (nhwc); 144->24 0.072 / 0.064; 3x3 64->64 on 56 x 56 0.102 / 0.100,
   on 8 x 224 x 224 0.259 / 0.227 with halo tiles), nor in bf16 (512->512 3x3 on 7 x 7 0.067 /
   0.059, 256->256 on 14 x 14 0.047 / 0.040, 256->512 1x1 stride 2 0.047 / 0.044).
   Also channels_last 1x1 layers at stride 1 of short reductions (nhwc_tma.short_1x1: up to 5
   k-tiles, 320 16-bit or 160 float32 input channels), on persistent tiles that walk the layer
   (nhwc_tma's default_tiles quotes the A/B). H100, batch 32, same process, stream time of 20
   calls, us (nhwc_tma / nhwc / F.conv2d), bf16: 144->24 on 56 x 56 13.2 / 18.7 / 10.3; 64->64 6.9 /
   10.6 / 7.8; 96->96 16.4 / 21.3 / 12.2; 128->128 on 28 x 28 6.5 / 7.3 / 5.9; 64->256 on 56 x 56
   25.3 / 34.4 / 26.1; TF32: 64->64 23.0 / 26.8 / 20.0; 144->24 33.0 / 37.8 / 30.7. One block a tile,
   as the twenty-fifth session measured, lost on 64 input channels and more (64->64 0.055 / 0.040
   ms) and won only under 64 (bf16 24->144 0.058 / 0.080 / 0.046).
   NCHW calls too (the input transposed into the workspace as for nhwc, the output written
   straight from the accumulators), for the k x k layers nhwc would take. Same process, ms
   (nhwc_tma / nhwc / F.conv2d), TF32 then bf16: 256->256 3x3 on 8 x 56 x 56 0.170 / 0.198 /
   0.183-0.196 and 0.109 / 0.127 / 0.086-0.089; on 32 x 14 x 14 0.066 / 0.082 / 0.062 and 0.054 /
   0.072 / 0.051-0.075; 128->128 3x3 on 32 x 28 x 28 0.069 / 0.092 / 0.068 and 0.055 / 0.060 /
   0.052; stride 2 from 56 x 56 0.109 / 0.124 / 0.102-0.105 and 0.078 / 0.085 / 0.071; 512->512 3x3
   on 7 x 7 0.118 / 0.121 and 0.080 / 0.084. Its 1x1 NCHW layers were even or slower: 2048->512 on
   7 x 7 0.075 / 0.072 and 0.056 / 0.054; 256->1024 on 14 x 14 TF32 0.061 / 0.057; 256->512
   stride 2 0.157 / 0.154 and 0.130 / 0.134. And TF32 k x k NCHW layers of 33-64 output channels
   from 64 input channels or more, which wgmma took, where the output rows are not whole
   128-column tiles of wgmma's: same process, ms (nhwc_tma / wgmma / F.conv2d), 64->64 3x3 on 8 x
   224 x 224 0.299-0.310 / 0.355-0.363 / 0.322-0.334; on 32 x 56 x 56 0.100-0.110 / 0.108-0.117 /
   0.106-0.116; but on 4 x 256 x 256 0.218-0.220 / 0.199-0.204 / 0.232-0.234, so 256-wide rows stay
   on wgmma. In bf16 wgmma keeps them: 0.341 / 0.245 and 0.094 / 0.075 (with resident weights in
   two pipelines 0.214 and 0.083; on 4 x 256 x 256 0.143 against wgmma's 0.142).
   nhwc: channels_last calls (the families below take NCHW only) whose channels per group
   fill whole 16-byte chunks (4 float32, 8 bf16/fp16) into an even number of output channels
   a group: one implicit GEMM over the whole batch on tensor cores. H100, batch 32, ms (nhwc /
   direct / F.conv2d on channels_last): ResNet-50's 64->64 3x3 on 56 x 56 TF32 0.122 / 0.814 /
   0.065, strict 0.239 / 0.808 / 0.357, bf16 0.082 / 0.784 / 0.051; 256->512 1x1 stride 2 TF32
   0.108 / 10.1 / 0.058 (benchmarks/bench_layers.py).
   Also NCHW calls of dense layers (groups == 1) whose output planes are at most 32 x 32
   pixels: the input is transposed into the workspace and the output written in NCHW. The
   NCHW families tile each image apart, so a 7 x 7 or 14 x 14 plane leaves their tiles mostly
   empty; the batch-wide GEMM fills them. H100, ResNet-50 at batch 32, ms (nhwc / the NCHW
   family it replaced / F.conv2d): 512->512 3x3 on 7 x 7 TF32 0.174 / 0.622 (wgmma) / 0.092,
   strict 0.309 / 0.870 / 0.377, bf16 0.105 / 0.348 / 0.072; 128->128 3x3 stride 2 from
   56 x 56 TF32 0.152 / 0.260 (igemm) / 0.114, strict 0.269 / 1.162 / 0.277; 256->512 1x1
   stride 2 TF32 0.197 / 0.613 / 0.158; 512->128 1x1 on 28 x 28 TF32 0.109 / 0.200 / 0.057.
   On larger planes nhwc takes the wide dense layers too (_nchw_wide): 2-9 taps from at
   least 96 input channels (128 for 16-bit); and 1x1 layers from 128 channels or more are
   split between nhwc, wgmma and pointwise by plane and channels (_nchw_1x1). The NCHW families' k-steps are 16-32 channels of a halo tile, so
   their loop overhead grows with the channels; nhwc's are 32 channels of one tap, and its
   transpose costs one pass over the input. H100, same process, ms (nhwc / the family it
   replaced / F.conv2d), TF32 then bf16: 256->256 3x3 on 8 x 56 x 56 0.196 / 0.318 (wgmma) /
   0.158 and 0.127 / 0.174 / 0.088; 128->128 3x3 on 32 x 56 x 56 0.228 / 0.285 / 0.185 and 0.142
   / 0.165 / 0.123; 512->512 3x3 on 8 x 56 x 56 0.686 / 1.04 / 0.388 and 0.382 / 0.580 / 0.235;
   96->96 3x3 on 32 x 56 x 56 0.172 / 0.221 / 0.152 (bf16 0.135 / 0.129: 16-bit from 128); 128->128
   3x3 stride 2 on 8 x 112 x 112 0.130 / 0.262 (igemm) / 0.108 and 0.091 / 0.164 / 0.075; 1x1
   1024->1024 on 8 x 64 x 64 0.651 / 1.21 (wgmma; pointwise 0.790) / 0.248 and 0.372 / 0.726 /
   0.124; 256->256 1x1 on 16 x 56 x 56 0.131 / 0.178 / 0.074. The NCHW families keep the rest:
   64->64 3x3 on 32 x 56 x 56 wgmma 0.101 / nhwc 0.105 (bf16 0.070 / 0.082), on 4 x 256 x 256
   0.185 / 0.238; 128->128 5x5 on 16 x 64 x 64 0.330 / 0.340 (bf16 0.186 / 0.206); strict
   float32 (wgmma's 3xTF32: 256->256 3x3 0.455 / 0.749); grouped layers (igemm: ResNeXt's 32
   groups of 16 on 14 x 14 0.080 against 0.082; 2 groups of 128 even); 1x1 TF32 1024->256 on
   8 x 64 x 64 (pointwise 0.220 / nhwc 0.263). On planes of 28 x 28 pointwise takes the 1x1
   reductions to a quarter from at most 512 channels (pointwise / nhwc): 512->128 on 32 x 28 x
   28 TF32 0.070 / 0.094 (F.conv2d 0.050), bf16 0.065 / 0.075; 256->64 0.039 / 0.061, bf16 0.033
   / 0.052; but not 1024->256 (bf16 0.252 / 0.149) or 128->512 (TF32 0.094 / 0.071), and not
   on 14 x 14 (1024->256 TF32 0.121 / 0.073).
4. wgmma (sm_90a only): float32 (TF32, or strict as 3xTF32), bf16 and fp16, column
   stride 1, at least 64 output channels per group, one full wgmma k-step of input
   channels per group (8 float32, 16 bf16/fp16) and a reduction CIN_G*KH*KW >= 128
   (>= 64 for strict float32): Hopper's warpgroup MMA reads both operands from shared
   memory, which mma.sync cannot; compute-bound shapes gain most, and 3xTF32's three
   products a k-step make strict float32 compute-bound even at 1x1. Also float32 first
   layers: fewer than 8 input channels per group (padded to a k-step), a kernel other than
   1x1, at least 64 output channels per group and output rows of 256 or more (two whole
   128-column tiles), except 1-3 channels into at most 64 (igemm's packed taps win there);
   and on the same terms TF32 reductions under 128 whose channels per
   group are whole k-steps (8, 16, ...). Also float32 layers of 16-63 output channels per
   group from whole k-steps of input channels and reductions of 256 or more (128 strict),
   on such rows.
   1x1 kernels on planes over 32 x 32 (TF32 and 16-bit; strict float32 keeps wgmma) only
   where nhwc does not take them and the outputs are at least twice the inputs, or 16-bit
   from more than 256 inputs; pointwise runs the rest faster. H100, same process, ms (wgmma / pointwise / F.conv2d):
   128->512 on 32 x 56 x 56 TF32 0.216 / 0.322 / 0.132, bf16 0.127 / 0.238 / 0.077; 512->128
   bf16 0.191 / 0.233 / 0.076; but 256->64 on 32 x 56 x 56 TF32 0.123 / 0.100 / 0.088, bf16
   0.114 / 0.084 / 0.055; 512->128 TF32 0.319 / 0.227 / 0.125; 1024->256 on 8 x 64 x 64 TF32
   0.332 / 0.220 / 0.109.
5. pointwise: 1x1 kernels with >= 8 input channels per group: a per-image GEMM on
   tensor cores, memory-bound at these sizes, beats any direct loop.
   pointwise_tile before it: dense NCHW 1x1 layers in TF32 from 12-64 input channels into 32 or
   more on planes of POINTWISE_LARGE_PLANE pixels and more: one block a 128 x 128 tile, two an
   SM (64 x 128, four an SM, for layers of up to 64 outputs), as cuDNN runs case 87, where
   pointwise's persistent blocks walk the tiles 0.6-0.9% slower than the bytes move in that
   structure.
   H100, same process, stream time of 20 calls, us (pointwise_tile / pointwise / F.conv2d):
   case 87 (64->128 on 16 x 1024 x 1024) 4639 / 4695-4741 / 4637; 32->128 3919 / 4436 / 3920;
   64->64 3087 / 3144 / 3042; 64->256 on 4 x 1024 x 1024 1956 / 2361 / 1951; 64->128 on 32 x 256 x
   256 564 / 589-607 / 569; 48->96 on 8 x 512 x 512 436 / 669 / 441; 16->128 on 8 x 512 x 512 445
   / 448 / 443; 64->128 on 8 x 128 x 128 42.4 / 45.5 / 42.4; 64->128 on 2 x 64 x 64 7.9 / 8.1 / 5.3.
   With 64-channel tiles for layers of up to 64 outputs (another call): 64->32 on 16 x 1024 x
   1024 2199 / 2228 / 2199 (2558 with 128-channel tiles); 64->64 3042 / 3154 / 3039; 24->64 on
   8 x 512 x 512 266 / 279 / 265; 12->64 on 16 x 512 x 512 462 / 480 / 615; 32->48 473 / 489 / 472.
   On 56 x 56 planes pointwise_tma stays ahead (64->256 on 32: 55.8 against 57.6); pointwise keeps
   8 input channels (8->128 even: 3374 / 3361-3368).
6. igemm: other kernels with >= 4 input channels per group: the implicit GEMM's
   reduction (CIN_G*KH*KW) is long enough to feed tensor cores. Below 4 channels too
   for TF32 and 16-bit, and for strict float32 (3xTF32) with at most 9 kernel taps or
   with its taps packed into the reduction (pack_k: stems such as 3->64 7x7 stride 2).
7. direct: everything else (NCHW layers of tiny channel counts the others refuse, channels_last
   layers of 9-15 channels that are not whole 16-byte chunks, float64, depthwise kernels over 9x9
   in channels_last, strided layouts the fast families do not take). It honours arbitrary strides,
   so it never copies.

Sampled 1x1 layers (CUDA, NCHW, before the list above): a 1x1 layer of one group, no padding
and a stride reads only every sh-th row and sw-th column of its input, so kernelgen computes it as
the stride-1 layer of the view input[..., ::sh, ::sw] (sampled_1x1). The families above then see a
plane of the output's size: pointwise_tma takes TF32 and 16-bit (through a dense copy of the view,
a quarter of the input at stride 2), nhwc transposes only the pixels it reads. Channels_last calls
keep their strided kernels (nhwc_tma's im2col steps over the pixels it skips; on the view the
NCHW families served them at 2-4x the time). H100, batch 32, same process, stream time of 20
calls, us (on the input with stride 2 / on the view / F.conv2d): ResNet-50's 256->512 from 56 x
56 TF32 139.1 (nhwc) / 82.0 (pointwise_tma) / 132.2, strict 258.2 / 237.1 / 171.9, bf16 104.4 /
51.9 / 95.4; 512->1024 from 28 x 28 TF32 98.7 / 76.1 / 85.3, strict 210.6 / 207.9 / 211.4, bf16
71.3 / 66.0 / 59.1; 1024->2048 from 14 x 14 TF32 86.6 / 87.1 / 60.9, strict 236.6 / 239.5 /
204.0, bf16 48.9 / 43.0 / 42.2. Forced families (`family=`) run the call as it is.

Layout: the output's memory format follows F.conv2d (channels_last if the input or
the weight is). Families take 'nchw', 'nhwc' or 'any'; a family that needs a dense
layout gets the input made contiguous in it (one copy when it is not already) and
writes the output in that same layout. A family is only chosen when its layout is
the output's layout, or when it is 'any'. (nhwc takes both: for 'nchw' it transposes the
input itself, into its workspace, and writes NCHW.)

CPU: the one CPU family.

A user or a tuner can force a family and its tiles (`family=`, `tiles=`); then the
family must accept the spec or the call fails with its reason. Tiles without a family
narrow the choice to the families that have every tile named: the first of them in the
order above that accepts the spec and would be chosen for it, else the first that accepts it.
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import ConvArgumentError, Unsupported
from .families import get_family
from .families.base import element_size
from .families.nhwc_tma import k_tiles as tma_k_tiles, short_1x1 as tma_short_1x1
from .spec import ConvSpec, Problem

CUDA_ORDER = ("depthwise_planes", "depthwise", "depthwise_nhwc", "grouped_nhwc", "grouped_mma", "stem_nhwc", "pointwise_tma", "nhwc_tma", "nhwc", "wgmma",
              "pointwise_tile", "pointwise", "igemm", "direct")
CPU_ORDER = ("cpu_direct",)
# NCHW depthwise planes up to this many elements go to depthwise_planes (module docstring, item 1).
SMALL_PLANE = 256
# NCHW 1x1 reductions under 96 channels take pointwise_tma only on output planes smaller than this
# (item 2): from here pointwise's 16-warp tiles run them (case 87), except on wide-DRAM GPUs.
POINTWISE_LARGE_PLANE = 4096


def _available(names: tuple[str, ...]) -> list[str]:
    from .families import all_families

    fams = all_families()
    return [n for n in names if n in fams]


def _layout_for(family_layouts: tuple[str, ...], channels_last: bool) -> str | None:
    want = "nhwc" if channels_last else "nchw"
    if want in family_layouts:
        return want
    if "any" in family_layouts:
        return "any"
    return None


def choose(params: Mapping[str, Any], device: str, problem: Problem, channels_last: bool, math: str,
           family: str | None = None, tiles: Mapping[str, int] | None = None) -> ConvSpec:
    """The spec to compile for a call. `params` are the call's spec fields (checks.spec_params)."""
    if family is not None:
        names = [family]
    else:
        names = _available(CUDA_ORDER if device == "cuda" else CPU_ORDER)
    reasons = []
    spare = None  # tiles without a family: the first family that has them and accepts the spec
    for name in names:
        fam = get_family(name)
        missing = sorted(set(tiles or ()) - set(fam.tiles))
        if family is None and missing:  # forced tiles pick among the families that have them
            reasons.append(f"{name}: has no tile parameter(s) {missing}")
            continue
        layout = _layout_for(fam.layouts, channels_last)
        if layout is None:
            reasons.append(f"{name}: takes layouts {list(fam.layouts)}")
            continue
        base = ConvSpec(**params, device=device, layout=layout, math=_family_math(fam, params["dtype"], math),
                        family=name)
        try:
            spec = _family_spec(fam, base, problem, tiles)
        except Unsupported as exc:
            reasons.append(f"{name}: {exc}")
            continue
        if family is None and not _worth_it(name, spec, problem, math):
            spare = spare or (spec if tiles else None)
            continue
        return spec
    if spare is not None:
        return spare
    if family is not None:
        raise ConvArgumentError(f"family {family!r} cannot serve this convolution: {'; '.join(reasons)}")
    raise ConvArgumentError(f"no kernel family serves this convolution on {device}: {'; '.join(reasons)}")


def sampled_1x1(spec: ConvSpec, device: str, channels_last: bool) -> tuple[int, int] | None:
    """(sh, sw) where the call is computed as the stride-1 layer of input[..., ::sh, ::sw]
    (module docstring, "Sampled 1x1 layers"): CUDA, NCHW, one group, a 1x1 kernel, no padding
    and a stride other than 1. `spec`: the call's validated parameters. Else None."""
    if (device != "cuda" or channels_last or spec.groups != 1 or spec.kernel_size != (1, 1)
            or any(spec.padding) or spec.stride == (1, 1)):
        return None
    return spec.stride


def _family_math(fam, dtype: str, math: str) -> str:
    """The math a family runs a call in: the call's for float32 on a TF32-capable family, else exact."""
    return math if (fam.tf32 and dtype == "float32") else "ieee"


def _family_spec(fam, base: ConvSpec, problem: Problem, tiles: Mapping[str, int] | None = None) -> ConvSpec:
    """`fam`'s spec for the call `base` describes: tiles first (chosen from the shape, `tiles`
    forced over them), then the family's verdict on the whole spec, since its check may depend on
    the tiles (e.g. a k-step the dtype's MMA needs). Raises Unsupported."""
    chosen = dict(fam.default_tiles(base, problem, fixed=tiles))  # may find that nothing fits
    if tiles:
        chosen.update(tiles)
    spec = base.replace(tiles=tuple(chosen.items()))
    fam.check(spec)
    return spec


def _takes(name: str, spec: ConvSpec, problem: Problem, math: str) -> bool:
    """Whether family `name` accepts the call `spec` describes (another family's spec for it),
    with its default tiles for the shape and the call's math."""
    fam = get_family(name)
    if spec.layout not in fam.layouts:
        return False
    try:
        _family_spec(fam, spec.replace(family=name, math=_family_math(fam, spec.dtype, math), tiles=()), problem)
    except Unsupported:
        return False
    return True


def _nchw_wide(spec: ConvSpec) -> bool:
    """NCHW dense k x k layers that nhwc serves faster than the NCHW families on any plane
    (module docstring, item 3): 2-9 taps from >= 96 input channels (16-bit: 128). Not strict
    float32 (wgmma's 3xTF32 wins there)."""
    kh, kw = spec.kernel_size
    if spec.groups != 1 or (spec.dtype == "float32" and spec.math == "ieee"):
        return False
    return 1 < kh * kw <= 9 and spec.in_channels >= (96 if spec.dtype == "float32" else 128)


def _nchw_1x1(spec: ConvSpec, problem: Problem) -> str | None:
    """The family for an NCHW dense 1x1 layer from >= 128 input channels in TF32 or 16-bit
    (module docstring, items 3-5), or None where the general rules decide. Of the three that
    serve it, by output plane and channels: planes up to 32 x 32 nhwc, except pointwise for
    reductions to a quarter or less from at most 512 channels on planes of 28 x 28 or more;
    larger planes nhwc from 256 into 256 or more (float32: into at least half as many), wgmma
    into twice the inputs or more, or 16-bit from over 256, else pointwise. Where the pick
    refuses the spec the dispatcher's order goes on (pointwise takes any 1x1). On Hopper
    pointwise_tma comes first (item 2): this decides its 64-channel layers, planes it cannot
    address and strict float32."""
    if (spec.layout != "nchw" or spec.groups != 1 or spec.kernel_size != (1, 1) or spec.in_channels < 128
            or (spec.dtype == "float32" and spec.math == "ieee")):
        return None
    cin, cout, plane = spec.in_channels, spec.out_channels, problem.P * problem.Q
    wide = spec.dtype != "float32"
    if plane <= 1024:
        return "pointwise" if plane >= 784 and 4 * cout <= cin <= 512 else "nhwc"
    if cin >= 256 and cout >= 256 and (wide or 2 * cout >= cin):
        return "nhwc"
    if cout >= 2 * cin or (wide and cin > 256):
        return "wgmma"
    return "pointwise"


def _worth_it(name: str, spec: ConvSpec, problem: Problem, math: str) -> bool:
    """The size thresholds from the module docstring (correctness is the family's check).
    `math`: the call's float32 math ('tf32' or 'ieee'); a family without TF32 has 'ieee' in
    its spec either way."""
    kh, kw = spec.kernel_size
    strict = spec.dtype == "float32" and spec.math == "ieee"
    if name == "grouped_nhwc":
        if spec.dtype == "float32" and math == "ieee":
            return True  # exact FMAs: 16 channels a group and more (nhwc's 3xTF32, igemm's)
        if spec.layout == "nchw":  # against igemm: up to 8 channels a group, except TF32 groups of
            # 8 (one MMA k-step), which run faster on grouped_mma where it takes them
            return spec.cin_per_group < 8 or (spec.cin_per_group == 8 and not (
                spec.dtype == "float32" and _takes("grouped_mma", spec, problem, math)))
        # Float32 FMAs beat nhwc's tensor cores up to 8 channels a group; past that, only where
        # nhwc cannot take the group (channels that are not whole 16-byte chunks).
        vec = 4 if spec.dtype == "float32" else 8
        return spec.cin_per_group <= 8 or spec.cin_per_group % vec != 0
    if name == "grouped_mma":  # against nhwc: groups of up to 16 input channels; NCHW (against igemm): 32
        return spec.cin_per_group <= (32 if spec.layout == "nchw" else 16)
    if name == "stem_nhwc":  # (its check: dense, at most 8 input channels) up to 4; 5-8 that nhwc cannot
        # take (not whole 16-byte chunks); 16-bit 7x7 kernels and larger
        vec = 4 if spec.dtype == "float32" else 8
        return spec.in_channels <= 4 or spec.in_channels % vec != 0 or (spec.dtype != "float32" and kh * kw >= 49)
    if name == "depthwise_planes":  # input planes of at most SMALL_PLANE elements
        return problem.H * problem.W <= SMALL_PLANE
    if name == "pointwise_tma":  # into at least one whole wgmma N: reductions of 96 channels or more,
        # or (planes under POINTWISE_LARGE_PLANE, any plane on a wide-DRAM GPU) of at least three
        # quarters of a 128-byte k-tile
        if spec.out_channels < 64:
            return False
        if spec.in_channels >= 96:
            return True
        small = problem.P * problem.Q < POINTWISE_LARGE_PLANE
        return (small or problem.wide_dram) and spec.in_channels * element_size(spec) >= 96
    if name == "nhwc_tma":
        (sh, sw), k_tiles = spec.stride, tma_k_tiles(spec)
        if spec.layout == "nchw":  # where nhwc would take it (both transpose the input, TF32 rounded)
            # and TF32 k x k layers of 33-64 output channels (a 64-channel tile at least half full)
            # from 64 input channels or more, on rows that wgmma's 128-column tiles do not fill
            tf32_narrow = (spec.dtype == "float32" and 32 < spec.out_channels <= 64 and spec.in_channels >= 64
                           and problem.Q % 128 != 0)
            return k_tiles >= 4 and kh * kw > 1 and (tf32_narrow or _worth_it("nhwc", spec, problem, math))
        # TF32 with a_regs tiles (the default past 64 output channels) pays no rounded copy, and
        # beat nhwc on short, strided and 1x1 windows too
        if spec.dtype == "float32" and dict(spec.tiles).get("a_regs", 0) == 1:
            return True
        # (1x1 layers of short reductions too, whose tiles walk: nhwc_tma.short_1x1)
        if tma_short_1x1(spec):
            return True
        return k_tiles >= 4 and (spec.dtype != "float32" or kh * kw >= 4 * sh * sw)
    if name == "nhwc":
        # channels_last calls: always (the NCHW families do not take them). NCHW calls: the 1x1
        # table's pick; else dense layers with output planes of at most 32 x 32, where the
        # per-image tiles of the NCHW families run part empty and the batch-wide GEMM pays for
        # its input transpose, and wide ones on any plane (_nchw_wide).
        if spec.layout == "nhwc":
            return True
        pick = _nchw_1x1(spec, problem)
        if pick is not None:
            return pick == "nhwc"
        return (spec.groups == 1 and problem.P * problem.Q <= 1024) or _nchw_wide(spec)
    if name == "pointwise_tile":  # (its check: dense, TF32, at most 64 input channels)
        return (spec.in_channels >= 12 and spec.out_channels >= 32
                and problem.P * problem.Q >= POINTWISE_LARGE_PLANE)
    if name == "pointwise":
        return spec.cin_per_group >= 8
    if name == "igemm":
        # First layers (1-3 input channels), H100, ms (igemm / direct / F.conv2d): 3->64 3x3 on
        # 16 x 512 x 512 TF32 0.59 / 2.07 / 0.89, bf16 0.67 / 2.02 / 1.06, strict 0.99 / 2.04;
        # 3->32 3x3 stride 2 on 32 x 224 x 224 TF32 0.11 / 0.22 / 0.08, strict 0.16 / 0.22;
        # 3->64 3x3 on 32 x 224 x 224 strict 0.47 / 0.80 / 0.36. Strict 3xTF32 lost on larger
        # kernels: 3->64 5x5 on 8 x 512 x 512 2.06 / 1.64, 7x7 stride 2 on 32 x 224 x 224
        # 0.90 / 0.78. With the taps packed into the reduction (pack_k) it wins there too: 7x7
        # stride 2 strict 0.28 / 0.78 / 0.39.
        return spec.cin_per_group >= 4 or not strict or kh * kw <= 9 or dict(spec.tiles).get("pack_k", 0) == 1
    if name == "wgmma":
        # Reductions of 128 and more. H100: case 56 (64x5x7) TF32 2.31 ms vs igemm 7.23, bf16 1.39
        # vs 5.67; case 63 (16x3x3) TF32 7.34 vs igemm 8.54, bf16 4.62 vs 6.33 (both staged);
        # case 87 (64x1x1) TF32 9.1 vs pointwise 4.7, bf16 4.8 vs 3.1 (before staging; 5.00 vs
        # 4.79 since). Strict float32 (3xTF32) from 64: case 87 5.42-5.46 vs pointwise 6.47.
        if (spec.cout_per_group >= 64 and spec.cin_per_group >= (8 if spec.dtype == "float32" else 16)
                and spec.cin_per_group * kh * kw >= (64 if strict else 128)):
            pick = _nchw_1x1(spec, problem)
            return pick is None or pick == "wgmma"
        # float32 first layers, H100, ms (wgmma / igemm / direct / F.conv2d), TF32 then strict:
        # 3->64 3x3 on 16 x 512 x 512 0.52 / 0.59 / 2.07 / 0.89 and 0.71 / 0.99 / 2.04 / 0.89;
        # 3->64 5x5 on 8 x 512 x 512 0.44 / 0.89 / 1.62 / 0.74 and 0.63 / 2.06 / 1.64 / 0.74;
        # 4->64 3x3 0.53 / 0.60 and 0.73 / 1.02 (F.conv2d 0.99); 2->64 3x3 on 16 x 256 x 256
        # 0.16 / 0.16 and 0.21 / 0.27 / 0.28 / 0.22. On 224-wide rows (a 96-column second
        # tile) igemm wins: 3->64 3x3 on 32 x 224 x 224 TF32 0.40 / 0.28. bf16 was even (3->64
        # 3x3: 0.66 / 0.67), so 16-bit keeps igemm.
        # TF32 reductions under 128 from whole k-steps of channels, H100, same process (wgmma /
        # igemm / F.conv2d, ms): 8->64 3x3 on 16 x 512 x 512 0.495 / 0.627 / 1.354; 8->128 3x3 on
        # 8 x 512 x 512 0.476 / 0.624; 8->64 3x1 0.505 / 0.537; row stride 2 0.293 / 0.391; on 16 x
        # 256 x 256 0.154 / 0.182; 16->64 3x1 0.649 / 0.743; 16->64 1x3 0.529 / 0.602; 32->128 3x1
        # on 8 x 512 x 512 0.823 / 1.023 / 1.559; 24->128 3x1 0.641 / 1.287 / 0.817. 224-wide rows
        # lose (0.393 / 0.294), 12 channels (padded to 16) are even (0.912 / 0.909), and bf16 8-
        # and 12-channel layers lose (0.725 / 0.666, 0.845 / 0.655).
        # Since igemm packs taps into its reduction (pack_k), 1-3 channels into 64 outputs per group
        # run faster there (igemm / wgmma, ms): TF32 3->64 3x3 on 16 x 512 x 512 0.49 / 0.52, 5x5 on
        # 8 x 512 x 512 0.36 / 0.42; strict 3->64 3x3 0.67 / 0.75, 2->64 3x3 on 16 x 256 x 256 0.17 /
        # 0.21, but not strict 5x5 (0.66 / 0.61), 4 channels (TF32 0.60 / 0.57) or 128 outputs (TF32
        # 3->128 3x3 0.95 / 0.86).
        cin = spec.cin_per_group
        packed_first = cin <= 3 and spec.cout_per_group <= 64 and (not strict or kh * kw <= 9)
        if (spec.dtype == "float32" and (cin < 8 or (not strict and cin % 8 == 0)) and kh * kw > 1
                and spec.cout_per_group >= 64 and problem.Q >= 256 and not packed_first):
            return True
        # float32 layers of 16-63 output channels per group (the MMA's 64 rows partly idle) from
        # reductions of 256 or more, H100, 8 x 512 x 512 padding 1, ms (wgmma / igemm / F.conv2d),
        # TF32: 32->16 3x3 0.62 / 0.73 / 0.73, 32->32 0.61 / 0.89 / 0.80, 64->16 1.16 / 2.38 / 1.28,
        # 64->32 1.16 / 2.61 / 1.30, 8->16 7x7 (16 x 512 x 512) 1.10 / 1.94 / 4.48; strict: 32->32
        # 2.02 on igemm against 1.27 (F.conv2d 1.40), 64->32 9.27 against 2.36 (2.62), and from 128
        # (16->32 0.81 against 0.55, 16->16 even). Shorter TF32 ones keep igemm (16->32 3x3 0.43 /
        # 0.39, 16->16 0.46 / 0.33), and so does 16-bit (32->32 bf16 0.41 / 0.37, 64->32 0.77 /
        # 0.69).
        return (spec.dtype == "float32" and cin % 8 == 0 and kh * kw > 1 and 16 <= spec.cout_per_group < 64
                and cin * kh * kw >= (128 if strict else 256) and problem.Q >= 256)
    return True
